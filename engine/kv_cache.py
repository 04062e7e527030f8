"""The KV cache tensors and their sizing.

Layout (DESIGN.md §3): ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``, block
major, so one block is one contiguous region holding every layer's K and V for ``block_size``
tokens: a transfer of N blocks is N descriptors (fewer when block ids are contiguous).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.kv_quant import QuantizedKVCache
from engine.kv_quant import block_bytes as quantized_block_bytes
from engine.models.llama import ModelSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the model's (activations, and a full-precision cache)
    kv_dtype: torch.dtype | None = None  # quantized storage (int8, float8_e4m3fn), scales beside

    @classmethod
    def from_spec(
        cls, spec: ModelSpec, block_size: int, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
    ) -> KVLayout:
        return cls(spec.num_layers, block_size, spec.num_kv_heads, spec.head_dim, dtype, kv_dtype)

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """One block's bytes: its K/V, and for a quantized cache its scales."""
        if self.kv_dtype is not None:
            return quantized_block_bytes(self.block_shape)
        n = 1
        for d in self.block_shape:
            n *= d
        return n * self.dtype.itemsize

    def allocate(self, num_blocks: int, device: str | torch.device):
        """A tensor ``[num_blocks, *block_shape]``, or for a quantized cache a ``QuantizedKVCache``."""
        if self.kv_dtype is not None:
            return QuantizedKVCache.allocate(num_blocks, self.block_shape, self.kv_dtype, device)
        return torch.zeros((num_blocks, *self.block_shape), dtype=self.dtype, device=device)


def num_blocks_for_budget(layout: KVLayout, budget_bytes: int) -> int:
    n = budget_bytes // layout.block_bytes
    if n < 1:
        raise ValueError(
            f"KV budget of {budget_bytes} bytes is below one block ({layout.block_bytes} bytes); raise it"
        )
    return int(n)


def gpu_kv_budget(device: torch.device, utilization: float) -> int:
    """Bytes left for KV after weights: ``utilization`` of the device total, minus what is in use."""
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    budget = int(total * utilization) - used
    if budget <= 0:
        raise ValueError(f"no GPU memory left for the KV cache at gpu_memory_utilization={utilization}")
    return budget
