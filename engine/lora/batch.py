"""One step's adapters: which slot each token of the flat batch uses, and the update a projection adds.

``y[t] += (x[t] @ A[s].T) @ B[s].T`` with ``s`` the adapter slot of token ``t`` (-1: the base model, no
update), for a batch that mixes adapters. ``lora_update_ref`` is the torch implementation (one pair of
matmuls per adapter in the batch; the CPU engine runs it and the Triton kernels are tested against
it); on CUDA ``engine.lora.kernels.lora_update`` runs the same update over tiles (``make_tiles``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TILE = 16  # tokens per tile of the Triton kernels: tl.dot's smallest block


def lora_update_ref(
    y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> None:
    """``y += delta`` in place (``y`` ``[T, O]``, ``x`` ``[T, K]``, ``slots`` ``[T]``; ``a``
    ``[slots, N, K]``, ``b`` ``[slots, O, N]``)."""
    for s in torch.unique(slots).tolist():
        if s < 0:
            continue
        rows = (slots == s).nonzero().squeeze(1)
        xs = x.index_select(0, rows)
        y.index_add_(0, rows, ((xs @ a[s].to(xs.dtype).T) @ b[s].to(xs.dtype).T).to(y.dtype))


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


@dataclass(slots=True)
class LoraBatch:
    """The adapters of one forward: ``weights`` (``engine.lora.slots.LoraSlots``), each token's slot,
    and on CUDA the tiles the kernels run over."""

    weights: object
    token_slots: torch.Tensor  # [T] int64, -1: the base model
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, weights, token_slots: list[int], device: torch.device) -> LoraBatch:
        slots = torch.tensor(token_slots, dtype=torch.int64)
        if device.type != "cuda":
            return cls(weights, slots)
        tiles = tuple(
            torch.tensor(part, dtype=torch.int32).to(device, non_blocking=True)
            for part in make_tiles(token_slots)
        )
        return cls(weights, slots.to(device, non_blocking=True), tiles)

    def update(self, y: torch.Tensor, x: torch.Tensor, layer: int, proj: str) -> None:
        """Add the batch's adapters' update of projection ``proj`` of ``layer`` to ``y`` in place."""
        a, b = self.weights.layer_weights(layer, proj)
        if self.tiles is None:
            lora_update_ref(y, x, self.token_slots, a, b)
            return
        from engine.lora.kernels import lora_update

        lora_update(y, x, self.tiles, a, b, TILE)
