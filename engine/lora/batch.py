"""One step's adapters: which slot each token of the flat batch uses, and the update a projection adds.

``y[t] += x[t] @ A[s] @ B[s]`` with ``s`` the adapter slot of token ``t`` (-1: the base model, no
update), for a batch that mixes adapters; a fused projection's ``B`` comes in parts, each onto its
own output columns (``engine.lora.slots``). ``lora_update_ref`` is the torch implementation (one pair of
matmuls per adapter in the batch; the CPU engine runs it and the Triton kernels are tested against
it); on CUDA ``engine.lora.kernels.lora_update`` runs the same update over tiles (``make_tiles``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.device_copy import to_device

TILE = 16  # tokens per tile of the Triton kernels: tl.dot's smallest block


def lora_update_ref(y: torch.Tensor, x: torch.Tensor, slots, a: torch.Tensor, parts) -> None:
    """``y += delta`` in place (``y`` ``[T, O]``, ``x`` ``[T, K]``, ``slots``: each token's slot, a
    list or a ``[T]`` tensor; ``a`` ``[slots, K, P * R]``; ``parts``: P ``(b [slots, R, O_i], lo, hi)``,
    part ``i``'s expand and its output columns, ``engine.lora.slots.LoraSlots.layer_weights``)."""
    apply_groups(y, x, slot_groups(slots.tolist() if isinstance(slots, torch.Tensor) else slots), a, parts)


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


def long_runs(token_slots: list[int], min_len: int = TILE) -> tuple[list[tuple[int, slice]], list[int]]:
    """The runs of at least ``min_len`` consecutive tokens of one adapter (prefill chunks), and the
    token slots with those runs' tokens set to -1 (the rest, for the batched layout)."""
    runs: list[tuple[int, slice]] = []
    rest = list(token_slots)
    start = 0
    for t in range(1, len(token_slots) + 1):
        if t == len(token_slots) or token_slots[t] != token_slots[start]:
            if token_slots[start] >= 0 and t - start >= min_len:
                runs.append((token_slots[start], slice(start, t)))
                rest[start:t] = [-1] * (t - start)
            start = t
    return runs, rest


def apply_groups(y: torch.Tensor, x: torch.Tensor, groups, a: torch.Tensor, parts) -> None:
    """One shrink and one expand per part for each ``(slot, rows)``: a slice of rows is updated in
    place (``addmm_`` on ``y``'s view: no copy of the rows), index rows by ``index_add_``."""
    r = a.shape[2] // len(parts)
    for s, rows in groups:
        xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
        xa = xs @ a[s].to(xs.dtype)
        for i, (b, lo, hi) in enumerate(parts):
            xa_i, b_i = xa[:, i * r : (i + 1) * r], b[s].to(xs.dtype)
            if isinstance(rows, slice) and y.dtype == xs.dtype:
                y[rows, lo:hi].addmm_(xa_i, b_i)
            elif isinstance(rows, slice):
                y[rows, lo:hi] += (xa_i @ b_i).to(y.dtype)
            else:
                y[:, lo:hi].index_add_(0, rows, (xa_i @ b_i).to(y.dtype))


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
    the update as batched matmuls over every slot: a fixed number of ops per projection, whatever
    the number of adapters (a loop over them costs 4 each: most of a decode step on a small model).
    ``index``: the token of each padded row (padding repeats token 0); ``mask``: 1 for a real row, 0
    for padding; ``inverse``: each token's padded row, a padding row (all zero after the mask) for a
    base-model token. The expand's rows go back to the tokens by ``inverse`` (a gather and a dense
    add): ``index_add_`` on this CPU scatters through an index as large as the output, and cannot
    add into one part's columns without a copy."""

    index: torch.Tensor  # [slots * G] int64
    mask: torch.Tensor | None  # [slots * G, 1]; None: no padding
    inverse: torch.Tensor  # [T] int64
    g: int

    @classmethod
    def plan(cls, groups, num_slots: int, num_tokens: int) -> PaddedSlots | None:
        """The layout, or None where padding would more than double the rows (a long prefill chunk
        beside decodes: the loop over adapters is cheaper there)."""
        rows = {s: (list(range(r.start, r.stop)) if isinstance(r, slice) else r.tolist()) for s, r in groups}
        num_adapted = sum(len(r) for r in rows.values())
        g = max(len(r) for r in rows.values())
        if num_adapted < num_tokens and num_slots * g == num_adapted:
            g += 1  # base-model tokens need a padding row to read their zero update from
        if num_slots * g > 2 * num_adapted + num_slots:
            return None
        index = [0] * (num_slots * g)
        mask = [0.0] * (num_slots * g)
        for s, r in rows.items():
            index[s * g : s * g + len(r)] = r
            mask[s * g : s * g + len(r)] = [1.0] * len(r)
        inverse = [mask.index(0.0) if num_adapted < num_tokens else 0] * num_tokens
        for row, (t, m) in enumerate(zip(index, mask, strict=True)):
            if m:
                inverse[t] = row
        padded = torch.tensor(mask).unsqueeze(1) if min(mask) == 0 else None
        return cls(
            torch.tensor(index, dtype=torch.int64), padded, torch.tensor(inverse, dtype=torch.int64), g
        )

    def apply(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, parts) -> None:
        slots = a.shape[0]
        xg = x.index_select(0, self.index).view(slots, self.g, x.shape[1])
        xa = torch.bmm(xg, a.to(x.dtype))  # [slots, G, P * R]
        if self.mask is not None:  # padding rows zeroed here, at rank width, not at the output's
            xa.mul_(self.mask.view(slots, self.g, 1).to(x.dtype))
        r = a.shape[2] // len(parts)
        for i, (b, lo, hi) in enumerate(parts):
            xa_i = xa if len(parts) == 1 else xa[:, :, i * r : (i + 1) * r]
            delta = torch.bmm(xa_i, b.to(x.dtype)).view(-1, hi - lo).index_select(0, self.inverse)
            (y if len(parts) == 1 else y[:, lo:hi]).add_(delta.to(y.dtype))


@dataclass(slots=True)
class LoraBatch:
    """The adapters of one forward: ``weights`` (``engine.lora.slots.LoraSlots``), each token's slot,
    and on CUDA the tiles the kernels run over (made when an eager step first needs them)."""

    weights: object
    token_slots: torch.Tensor  # [T] int64, -1: the base model
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    groups: list | None = None  # CPU: ``slot_groups`` of the tokens not in ``runs``
    padded: PaddedSlots | None = None  # CPU: the batched layout of those, where it pays
    runs: list | None = None  # CPU: ``long_runs``, each its own pair of matmuls on ``y``'s rows
    # CUDA: each token's slot, for the tiles of an eagerly launched step, made on its first update; a
    # decode step replayed from a CUDA graph reads ``token_slots`` only and never makes them.
    slot_list: list[int] | None = None

    @classmethod
    def build(cls, weights, token_slots: list[int], device: torch.device) -> LoraBatch:
        slots = torch.tensor(token_slots, dtype=torch.int64)
        if device.type != "cuda":
            # Prefill chunks run as themselves (a gather and a scatter of their rows would cost
            # more than their matmuls); decodes of many adapters in the batched layout.
            runs, rest = long_runs(token_slots)
            groups = slot_groups(rest)
            many = len(groups) > 1
            padded = PaddedSlots.plan(groups, weights.max_loras, len(token_slots)) if many else None
            return cls(weights, slots, groups=groups, padded=padded, runs=runs)
        return cls(weights, to_device(slots, device), slot_list=token_slots)

    def update(self, y: torch.Tensor, x: torch.Tensor, layer: int, proj: str) -> None:
        """Add the batch's adapters' update of projection ``proj`` of ``layer`` to ``y`` in place."""
        a, parts = self.weights.layer_weights(layer, proj)
        if self.slot_list is not None:
            from engine.lora.kernels import lora_update

            if self.tiles is None:
                device = self.token_slots.device
                self.tiles = tuple(
                    to_device(torch.tensor(part, dtype=torch.int32), device)
                    for part in make_tiles(self.slot_list)
                )
            lora_update(y, x, self.tiles, a, parts, TILE)
            return
        if self.runs:
            apply_groups(y, x, self.runs, a, parts)
        if self.padded is not None:
            self.padded.apply(y, x, a, parts)
            return
        apply_groups(y, x, self.groups, a, parts)


@dataclass(slots=True)
class GraphLora:
    """The adapters of a decode step replayed from a CUDA graph (``engine.cuda_graphs``): each row's
    slot in a static device buffer the runner fills before the replay (-1: the base model or a
    padding row), and per-token kernels whose launches depend only on the batch size."""

    weights: object
    token_slots: torch.Tensor  # [B] int64 on the device: a view of the graph runner's buffer

    def update(self, y: torch.Tensor, x: torch.Tensor, layer: int, proj: str) -> None:
        from engine.lora.kernels import lora_update_per_token

        a, parts = self.weights.layer_weights(layer, proj)
        lora_update_per_token(y, x, self.token_slots, a, parts)
