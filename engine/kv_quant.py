"""Quantized KV cache (``kv_cache_dtype`` int8 or fp8): fewer bytes per token stored, attended, shipped.

A block stays one contiguous region (a transfer is still one descriptor per block, a swap or a
copy-on-write one row): its quantized K/V, ``[num_layers, 2, block_size, kv_heads, head_dim]`` in
int8 or float8 (e4m3), then its float32 scales, ``[num_layers, 2, block_size, kv_heads]``: one per
token, layer, K or V, and KV head. ``QuantizedKVCache`` holds the raw bytes and the two typed views
of them.

A token's scale for a head is its largest magnitude over the format's range (127 for int8, 448 for
e4m3), computed when it is written. What a token stores therefore depends on that token alone, not
on which tokens were written with it or before it: a prompt computed whole or in chunks, a prefix
hit, and speculative decoding (a verify step writes k + 1 positions, the rejected ones rewritten
later) all store the same bytes as one token a step, so a quantized engine's output does not depend
on how its steps were grouped. (Scales per block, an earlier layout, grew with the tokens written
into the block and requantized its earlier tokens: a rejected draft's magnitude stayed in the
block, and speculation changed greedy output.) The price is 4 bytes per token, layer, K/V and head
beside ``head_dim`` bytes of data: 3% at head_dim 128. Blocks that arrive whole (NIXL pulls, swaps,
copy-on-write) carry their scales with them.
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
    scales: torch.Tensor  # float32 [num_blocks, num_layers, 2, block_size, kv_heads]

    @classmethod
    def allocate(
        cls, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, device
    ) -> QuantizedKVCache:
        raw = torch.zeros((num_blocks, block_bytes(block_shape)), dtype=torch.uint8, device=device)
        return cls.from_raw(raw, block_shape, dtype)

    @classmethod
    def from_raw(
        cls, raw: torch.Tensor, block_shape: tuple[int, ...], dtype: torch.dtype
    ) -> QuantizedKVCache:
        data_bytes = _numel(block_shape)
        n = raw.shape[0]
        data = raw[:, :data_bytes].view(dtype).view(n, *block_shape)
        scales = raw[:, data_bytes:].view(torch.float32).view(n, *block_shape[:-1])
        return cls(raw, data, scales)


def block_bytes(block_shape: tuple[int, ...]) -> int:
    """A quantized block's bytes: one per K/V element, then a float32 scale per token, layer, K/V and
    KV head (``block_shape`` = layers, 2, block size, KV heads, head dim)."""
    return _numel(block_shape) + _numel(block_shape[:-1]) * SCALE_BYTES


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


def store(
    cache: QuantizedKVCache, layer: int, kv: int, x: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor
) -> None:
    """Quantize ``x`` ([T, kv_heads, head_dim], float) into ``layer``'s K (kv = 0) or V (1) slots
    ``(blocks[t], offsets[t])``, each token with its own scale per head."""
    data = cache.data[:, layer, kv]  # [N, bs, kvh, hd]
    qmax = _QMAX[data.dtype]
    # NOTE: times the reciprocal, as CUDA computes a division by a scalar: the scales are then
    # bit-identical on CPU and GPU (a true division on CPU differed in the last bit).
    scale = (x.abs().amax(dim=-1).float() * (1.0 / qmax)).clamp(min=torch.finfo(torch.float32).tiny)
    cache.scales[:, layer, kv][blocks, offsets] = scale
    data[blocks, offsets] = _cast(x.float() / scale[:, :, None], data.dtype, qmax)


def gather(
    cache: QuantizedKVCache, layer: int, kv: int, block_ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Blocks ``block_ids`` of ``layer``'s K or V, dequantized: [n, block_size, kv_heads, head_dim]."""
    q = cache.data[:, layer, kv].index_select(0, block_ids)
    s = cache.scales[:, layer, kv].index_select(0, block_ids)  # [n, block_size, kv_heads]
    return (q.float() * s[..., None]).to(dtype)


def _cast(x: torch.Tensor, dtype: torch.dtype, qmax: float) -> torch.Tensor:
    x = x.clamp(-qmax, qmax)
    return x.round().to(dtype) if dtype == torch.int8 else x.to(dtype)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
