"""The seam between the model and an attention implementation.

A step's batch is flattened (varlen): the first ``num_decodes`` sequences contribute one query
token each, the rest are prefill chunks of any length over a (possibly cached) paged prefix. The
backend writes the new tokens' K/V into their slots, then attends over each sequence's context.

KV cache layout (block-major, DESIGN.md §3): ``[num_blocks, num_layers, 2, block_size,
num_kv_heads, head_dim]``; ``kv_cache[b, layer, 0]`` is block ``b``'s keys for ``layer``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(slots=True)
class AttentionMetadata:
    num_decodes: int
    # Per new token: the block and offset its K/V go to.
    slot_blocks: torch.Tensor  # [T] int64
    slot_offsets: torch.Tensor  # [T] int64
    # Per sequence (decodes first): context length after this step, query span in the flat batch.
    seq_lens: torch.Tensor  # [B] int64
    seq_lens_list: list[int]
    query_start_loc: list[int]  # [B + 1]
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    block_size: int
    # query_start_loc on the device, when the step's upload carried it (else backends build it).
    query_start_loc_tensor: torch.Tensor | None = None
    max_seq_len: int = 0  # max(seq_lens_list) where the builder knew it (0: not known)
    # Decode-only helpers, built once per step and shared by every layer: decodes (sorted by context
    # length, longest first) split into groups of similar length, each with its key mask.
    decode_groups: list[DecodeGroup] | None = None
    # The step's adapters (engine.lora.batch.LoraBatch), None when no token of it uses one.
    lora: object | None = None


@dataclass(slots=True)
class DecodeGroup:
    start: int
    end: int
    num_blocks: int
    key_mask: torch.Tensor  # [end - start, 1, 1, num_blocks * block_size] bool


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...

    def prepare(self, meta: AttentionMetadata) -> None:
        """Build per-step tensors shared by all layers (masks, indices)."""
        ...
