"""The adapters an engine serves: every loaded one in host memory, up to ``max_loras`` in device slots.

Each fused projection of each layer has one ``A`` ``[slots, in, parts * R]`` on the device and one
``B`` ``[slots, R, out_i]`` per part (``R``: ``max_lora_rank``; ``parts``: q, k, v of ``qkv``, gate
and up of ``gate_up``): the update is ``x @ A[s]`` once (the shrink), then part ``i``'s columns
``i*R .. (i+1)*R`` of it times that part's ``B[s]`` into the part's output columns (the expand).
Contiguous operands for the CPU's batched matmuls. Part ``i`` of an adapter of rank ``r`` fills
columns ``i*R .. i*R + r`` of its slot's ``A`` and rows ``0 .. r`` of its part's ``B``; the rest stays
zero. One ``B`` over all the parts' outputs would hold the parts' updates block-diagonally: half of
``gate_up``'s and two thirds of ``qkv``'s expand would multiply zeros, which cost a fused expand on
this CPU as much as the rest of the adapters' work.

A sequence pins its adapter's slot from the step that first runs it until it finishes or is
preempted (``acquire`` / ``release``); an adapter no sequence runs stays resident until a new one
needs its slot, least recently used first. The scheduler never runs more distinct adapters at once
than there are slots, so a pinned slot is never needed by another adapter.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch

from engine.lora.adapter import NUM_PARTS, AdapterError, LoraAdapter


class LoraSlots:
    def __init__(self, spec, max_loras: int, max_rank: int, device: torch.device, dtype: torch.dtype) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        h, q, kv, inter = (
            spec.hidden_size,
            spec.num_heads * spec.head_dim,
            spec.num_kv_heads * spec.head_dim,
            spec.intermediate_size,
        )
        shapes = {
            "qkv": (h, (q, kv, kv)),
            "o": (q, (h,)),
            "gate_up": (h, (inter, inter)),
            "down": (inter, (h,)),
        }
        self.part_rows = {p: _offsets(outs) for p, (_, outs) in shapes.items()}
        n, r = spec.num_layers, max_rank
        self.a = {
            p: torch.zeros((n, max_loras, k, NUM_PARTS[p] * r), dtype=dtype, device=device)
            for p, (k, _) in shapes.items()
        }
        self.b = {
            p: tuple(torch.zeros((n, max_loras, r, out), dtype=dtype, device=device) for out in outs)
            for p, (_, outs) in shapes.items()
        }
        self.adapters: dict[str, LoraAdapter] = {}
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # resident adapters, least recently used first
        self.pins: dict[str, int] = {}  # sequences running each adapter
        self.num_loads = 0  # adapters copied into a slot
        self.load_seconds = 0.0

    @property
    def bytes(self) -> int:
        tensors = [*self.a.values(), *(b for parts in self.b.values() for b in parts)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def layer_weights(self, layer: int, proj: str) -> tuple[torch.Tensor, tuple]:
        """``A`` ``[slots, in, parts * R]`` and each part's ``(B [slots, R, out_i], lo, hi)``:
        ``lo:hi`` its columns of the projection's output."""
        parts = tuple(
            (b[layer], lo, hi) for b, (lo, hi) in zip(self.b[proj], self.part_rows[proj], strict=True)
        )
        return self.a[proj][layer], parts

    def add(self, adapter: LoraAdapter) -> None:
        """Serve ``adapter`` (a new one, or new weights under a served name no sequence runs)."""
        if adapter.rank > self.max_rank:
            raise AdapterError(
                f"adapter {adapter.name!r}: rank {adapter.rank} exceeds max_lora_rank {self.max_rank}"
            )
        if self.pins.get(adapter.name):
            raise AdapterError(
                f"adapter {adapter.name!r} is in use by running requests; it cannot be replaced now"
            )
        self.slot_of.pop(adapter.name, None)  # its old weights' slot is free to reuse
        self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> None:
        if name not in self.adapters:
            raise KeyError(name)
        if self.pins.get(name):
            raise AdapterError(f"adapter {name!r} is in use by running requests")
        del self.adapters[name]
        self.slot_of.pop(name, None)

    def acquire(self, name: str) -> int:
        """The slot of adapter ``name`` (copied in if it is not resident), pinned for one sequence."""
        slot = self.slot_of.get(name)
        if slot is None:
            slot = self._free_slot()
            self._load(self.adapters[name], slot)
            self.slot_of[name] = slot
        self.slot_of.move_to_end(name)
        self.pins[name] = self.pins.get(name, 0) + 1
        return slot

    def release(self, name: str) -> None:
        left = self.pins[name] - 1
        if left:
            self.pins[name] = left
        else:
            del self.pins[name]

    def _free_slot(self) -> int:
        used = set(self.slot_of.values())
        for slot in range(self.max_loras):
            if slot not in used:
                return slot
        for name, slot in self.slot_of.items():  # least recently used first
            if not self.pins.get(name):
                del self.slot_of[name]
                return slot
        raise RuntimeError(
            f"every one of the {self.max_loras} adapter slots is pinned (the scheduler's bound)"
        )

    def _load(self, adapter: LoraAdapter, slot: int) -> None:
        t0 = time.perf_counter()
        r = self.max_rank
        for p in self.a:
            self.a[p][:, slot].zero_()
            for b in self.b[p]:
                b[:, slot].zero_()
        for (layer, p, part), m in adapter.modules.items():
            self.a[p][layer, slot, :, part * r : part * r + m.rank].copy_(m.a.T)
            self.b[p][part][layer, slot, : m.rank].copy_(m.b.T)
        self.num_loads += 1
        self.load_seconds += time.perf_counter() - t0


def _offsets(sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    out, at = [], 0
    for n in sizes:
        out.append((at, at + n))
        at += n
    return out
