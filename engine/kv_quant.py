"""Quantized KV cache (``kv_cache_dtype`` int8 or fp8): fewer bytes per token stored, attended, shipped.

A block stays one contiguous region (a transfer is still one descriptor per block, a swap or a
copy-on-write one row): its quantized K/V, ``[num_layers, 2, block_size, kv_heads, head_dim]`` in
int8 or float8 (e4m3), then its float32 scales, ``[num_layers, 2, kv_heads]``: one per block, layer,
K or V, and KV head. ``QuantizedKVCache`` holds the raw bytes and the two typed views of them.

Scales are computed when tokens are written: a block's scale for a head is the largest magnitude
written into it so far over the format's range (127 for int8, 448 for e4m3). A token larger than
the block's scale raises it, and the block's earlier tokens are requantized to the new scale (a
no-op multiply by 1 where nothing grew, so no host sync decides). A token written at offset 0
restarts the block (its previous owner's scale is dropped). Blocks that arrive whole (NIXL pulls,
swaps, copy-on-write) carry their scales with them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.config import KV_CACHE_DTYPES

_STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_BYTES = 4  # float32


def storage_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The quantized storage dtype, or None for ``auto`` (the model's dtype)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return _STORAGE.get(kv_cache_dtype)


class QuantizedKVCache(NamedTuple):
    raw: torch.Tensor  # uint8 [num_blocks, block_bytes]: row b is block b's whole region
    data: torch.Tensor  # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim], int8 or e4m3
    scales: torch.Tensor  # float32 [num_blocks, num_layers, 2, kv_heads]

    @classmethod
    def allocate(
        cls, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, device
    ) -> QuantizedKVCache:
        layers, two, _, kv_heads, _ = block_shape
        data_bytes = _numel(block_shape)  # one byte per element
        scale_bytes = layers * two * kv_heads * SCALE_BYTES
        raw = torch.zeros((num_blocks, data_bytes + scale_bytes), dtype=torch.uint8, device=device)
        return cls.from_raw(raw, block_shape, dtype)

    @classmethod
    def from_raw(
        cls, raw: torch.Tensor, block_shape: tuple[int, ...], dtype: torch.dtype
    ) -> QuantizedKVCache:
        layers, two, _, kv_heads, _ = block_shape
        data_bytes = _numel(block_shape)
        n = raw.shape[0]
        data = raw[:, :data_bytes].view(dtype).view(n, *block_shape)
        scales = raw[:, data_bytes:].view(torch.float32).view(n, layers, two, kv_heads)
        return cls(raw, data, scales)


def first_blocks(kv_cache, num_blocks: int):
    """The first ``num_blocks`` blocks of a cache (the pool's share; the rest is the CUDA-graph pad)."""
    if isinstance(kv_cache, QuantizedKVCache):
        return QuantizedKVCache(
            kv_cache.raw[:num_blocks], kv_cache.data[:num_blocks], kv_cache.scales[:num_blocks]
        )
    return kv_cache[:num_blocks]


def block_rows(kv_cache) -> torch.Tensor:
    """The tensor whose row ``b`` is block ``b``'s whole region (to copy, swap or transfer blocks)."""
    return kv_cache.raw if isinstance(kv_cache, QuantizedKVCache) else kv_cache


class SlotWrites(NamedTuple):
    """Where a step's new tokens go, grouped by block: the same for every layer, K and V."""

    blocks: torch.Tensor  # [T] the block of each token
    offsets: torch.Tensor  # [T] its offset in the block
    touched: torch.Tensor  # [U] the distinct blocks written
    inverse: torch.Tensor  # [T] each token's index in ``touched``
    restart: torch.Tensor  # [U] bool: the block is written from offset 0 (a new owner)

    @classmethod
    def of(cls, blocks: torch.Tensor, offsets: torch.Tensor) -> SlotWrites:
        touched, inverse = torch.unique(blocks, return_inverse=True)
        # NOTE: in uint8, not bool: CUDA's scatter_reduce has no bool kernel (CPU's has).
        restart = torch.zeros(touched.shape[0], dtype=torch.uint8, device=blocks.device).scatter_reduce(
            0, inverse, (offsets == 0).to(torch.uint8), "amax"
        )
        return cls(blocks, offsets, touched, inverse, restart.bool())


def store(cache: QuantizedKVCache, layer: int, kv: int, x: torch.Tensor, writes: SlotWrites) -> None:
    """Quantize ``x`` ([T, kv_heads, head_dim], float) into ``layer``'s K (kv = 0) or V (1) slots."""
    data = cache.data[:, layer, kv]  # [N, bs, kvh, hd]
    scales = cache.scales[:, layer, kv]  # [N, kvh]
    qmax = _QMAX[data.dtype]
    kvh = x.shape[1]
    touched, inverse = writes.touched, writes.inverse
    amax = x.abs().amax(dim=-1).float()  # [T, kvh]
    step_max = torch.zeros((touched.shape[0], kvh), device=x.device).scatter_reduce(
        0, inverse[:, None].expand(-1, kvh), amax, "amax"
    )
    old = torch.where(writes.restart[:, None], 0.0, scales[touched])
    # NOTE: times the reciprocal, as CUDA computes a division by a scalar: the scales are then
    # bit-identical on CPU and GPU (a true division on CPU differed in the last bit).
    new = torch.maximum(old, step_max * (1.0 / qmax)).clamp(min=torch.finfo(torch.float32).tiny)
    # Earlier tokens of a block whose scale grew: requantized to the new scale (ratio 1 elsewhere).
    ratio = torch.where(old > 0, old / new, 1.0)
    kept = data[touched].float() * ratio[:, None, :, None]
    data[touched] = _cast(kept, data.dtype, qmax)
    scales[touched] = new
    data[writes.blocks, writes.offsets] = _cast(x.float() / new[inverse][:, :, None], data.dtype, qmax)


def step_writes(meta) -> SlotWrites:
    """The step's ``SlotWrites``, computed by the first layer that stores and kept on ``meta``."""
    if meta.quant_writes is None:
        meta.quant_writes = SlotWrites.of(meta.slot_blocks, meta.slot_offsets)
    return meta.quant_writes


def gather(
    cache: QuantizedKVCache, layer: int, kv: int, block_ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Blocks ``block_ids`` of ``layer``'s K or V, dequantized: [n, block_size, kv_heads, head_dim]."""
    q = cache.data[:, layer, kv].index_select(0, block_ids)
    s = cache.scales[:, layer, kv].index_select(0, block_ids)
    return (q.float() * s[:, None, :, None]).to(dtype)


def _cast(x: torch.Tensor, dtype: torch.dtype, qmax: float) -> torch.Tensor:
    x = x.clamp(-qmax, qmax)
    return x.round().to(dtype) if dtype == torch.int8 else x.to(dtype)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
