"""One step's adapters: which slot each token of the flat batch uses, and the update a projection adds.

``y[t] += x[t] @ A[s] @ B[s]`` with ``s`` the adapter slot of token ``t`` (-1: the base model, no
update), for a batch that mixes adapters. ``lora_update_ref`` is the torch implementation (one pair of
matmuls per adapter in the batch; the CPU engine runs it and the Triton kernels are tested against
it); on CUDA ``engine.lora.kernels.lora_update`` runs the same update over tiles (``make_tiles``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TILE = 16  # tokens per tile of the Triton kernels: tl.dot's smallest block


def lora_update_ref(y: torch.Tensor, x: torch.Tensor, slots, a: torch.Tensor, b: torch.Tensor) -> None:
    """``y += delta`` in place (``y`` ``[T, O]``, ``x`` ``[T, K]``, ``slots``: each token's slot, a
    list or a ``[T]`` tensor; ``a`` ``[slots, K, N]``, ``b`` ``[slots, N, O]``)."""
    apply_groups(y, x, slot_groups(slots.tolist() if isinstance(slots, torch.Tensor) else slots), a, b)


def slot_groups(token_slots: list[int]) -> list[tuple[int, slice | torch.Tensor]]:
    """Each adapter slot of a batch with its tokens: a slice when they are one run (a prefill chunk,
    decodes next to each other), else their indices."""
    runs: dict[int, list[int]] = {}
    for t, s in enumerate(token_slots):
        if s >= 0:
            runs.setdefault(s, []).append(t)
    out: list[tuple[int, slice | torch.Tensor]] = []
    for s, rows in runs.items():
        if rows[-1] - rows[0] + 1 == len(rows):
            out.append((s, slice(rows[0], rows[-1] + 1)))
        else:
            out.append((s, torch.tensor(rows, dtype=torch.int64)))
    return out


def apply_groups(y: torch.Tensor, x: torch.Tensor, groups, a: torch.Tensor, b: torch.Tensor) -> None:
    for s, rows in groups:
        if isinstance(rows, slice):
            xs = x[rows]
            y[rows] += ((xs @ a[s].to(xs.dtype)) @ b[s].to(xs.dtype)).to(y.dtype)
        else:
            xs = x.index_select(0, rows)
            y.index_add_(0, rows, ((xs @ a[s].to(xs.dtype)) @ b[s].to(xs.dtype)).to(y.dtype))


def make_tiles(token_slots: list[int]) -> tuple[list[int], list[int], list[int]]:
    """(starts, lengths, slots) of the tiles covering the adapted tokens of a batch: runs of up to
    ``TILE`` consecutive tokens of one slot."""
    starts: list[int] = []
    lengths: list[int] = []
    slots: list[int] = []
    prev, run = -1, 0
    for t, s in enumerate(token_slots):
        if s >= 0 and s == prev and run < TILE:
            lengths[-1] += 1
            run += 1
        elif s >= 0:
            starts.append(t)
            lengths.append(1)
            slots.append(s)
            run = 1
        prev = s
    return starts, lengths, slots


@dataclass(frozen=True, slots=True)
class PaddedSlots:
    """A step's adapted tokens laid out ``[slots, G, ...]`` (G: the most tokens any slot has), for
    the update as two batched matmuls over every slot: 5 ops per projection, whatever the number of
    adapters (a loop over them costs 4 each: most of a decode step on a small model). ``index``: the
    token of each padded row (padding repeats token 0); ``mask``: 1 for a real row, 0 for padding."""

    index: torch.Tensor  # [slots * G] int64
    mask: torch.Tensor | None  # [slots * G, 1]; None: no padding
    g: int

    @classmethod
    def plan(cls, groups, num_slots: int, num_adapted: int) -> PaddedSlots | None:
        """The layout, or None where padding would more than double the rows (a long prefill chunk
        beside decodes: the loop over adapters is cheaper there)."""
        rows = {s: (list(range(r.start, r.stop)) if isinstance(r, slice) else r.tolist()) for s, r in groups}
        g = max(len(r) for r in rows.values())
        if num_slots * g > 2 * num_adapted + num_slots:
            return None
        index = [0] * (num_slots * g)
        mask = [0.0] * (num_slots * g)
        for s, r in rows.items():
            index[s * g : s * g + len(r)] = r
            mask[s * g : s * g + len(r)] = [1.0] * len(r)
        padded = torch.tensor(mask).unsqueeze(1) if min(mask) == 0 else None
        return cls(torch.tensor(index, dtype=torch.int64), padded, g)

    def apply(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        xg = x.index_select(0, self.index).view(a.shape[0], self.g, x.shape[1])
        xa = torch.bmm(xg, a.to(x.dtype))  # [slots, G, N]
        if self.mask is not None:  # padding rows zeroed here, at rank width, not at the output's
            xa.mul_(self.mask.view(a.shape[0], self.g, 1).to(x.dtype))
        delta = torch.bmm(xa, b.to(x.dtype)).view(-1, y.shape[1])
        y.index_add_(0, self.index, delta.to(y.dtype))


@dataclass(slots=True)
class LoraBatch:
    """The adapters of one forward: ``weights`` (``engine.lora.slots.LoraSlots``), each token's slot,
    and on CUDA the tiles the kernels run over."""

    weights: object
    token_slots: torch.Tensor  # [T] int64, -1: the base model
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    groups: list | None = None  # CPU: ``slot_groups``, found once per step for every layer
    padded: PaddedSlots | None = None  # CPU: the batched layout, where it pays

    @classmethod
    def build(cls, weights, token_slots: list[int], device: torch.device) -> LoraBatch:
        slots = torch.tensor(token_slots, dtype=torch.int64)
        if device.type != "cuda":
            groups = slot_groups(token_slots)
            adapted = sum(s >= 0 for s in token_slots)
            padded = PaddedSlots.plan(groups, weights.max_loras, adapted) if len(groups) > 1 else None
            return cls(weights, slots, groups=groups, padded=padded)
        tiles = tuple(
            torch.tensor(part, dtype=torch.int32).to(device, non_blocking=True)
            for part in make_tiles(token_slots)
        )
        return cls(weights, slots.to(device, non_blocking=True), tiles)

    def update(self, y: torch.Tensor, x: torch.Tensor, layer: int, proj: str) -> None:
        """Add the batch's adapters' update of projection ``proj`` of ``layer`` to ``y`` in place."""
        a, b = self.weights.layer_weights(layer, proj)
        if self.padded is not None:
            self.padded.apply(y, x, a, b)
            return
        if self.tiles is None:
            apply_groups(y, x, self.groups, a, b)
            return
        from engine.lora.kernels import lora_update

        lora_update(y, x, self.tiles, a, b, TILE)
