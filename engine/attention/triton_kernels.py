"""Triton paged-attention kernels over the block-major KV cache, each next to its torch oracle.

Layout: the cache is one tensor ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.
A layer's keys are the strided view ``kv_cache[:, layer, 0]`` of shape ``[num_blocks, block_size,
num_kv_heads, head_dim]`` (values: ``[:, layer, 1]``); the kernels take that view's strides and need
only the head dim to be contiguous. Token ``p`` of sequence ``s`` lives in block
``block_tables[s, p // block_size]`` at offset ``p % block_size``.

- ``store_kv``: writes the K/V of the step's T new tokens into their slots. Grid ``(T,)``: one program
  copies one token's ``[num_kv_heads, head_dim]`` K and V.
- ``paged_decode_attention``: one query per sequence, at position ``seq_len - 1``. Split-K: grid
  ``(B, num_kv_heads, num_partitions)``; a program takes one KV head with all its query heads (GQA: K/V
  are read once per group) over one ``partition_size`` chunk of the context, in tiles of
  ``DECODE_TILE`` tokens, and writes its partial max, sum and unnormalised accumulator; a reduction
  kernel (grid ``(B, num_heads)``) merges the partitions by log-sum-exp. With one partition the first
  kernel normalises and writes the output itself.
- ``paged_prefill_attention`` (``triton_prefill.py``): varlen query chunks over the paged context.

All attention kernels accumulate in float32 with an online softmax in base 2 (the scale is folded with
log2(e)), mask contexts that end mid-block and padded head dims, and take an optional sliding window:
a query at ``q_pos`` sees the keys with ``q_pos - window < pos <= q_pos``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime import JITFunction

LOG2E = 1.4426950408889634
DECODE_TILE = 32  # keys per inner step of the decode kernel (>= 16: tl.dot's minimum on GPUs)


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    # NOTE: Triton's interpreter multiplies bfloat16 operands as their raw uint16 bits; the launchers
    # set UPCAST there. The products are exact either way, so the result matches the GPU's.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


def is_interpreted() -> bool:
    """Whether the kernels were defined under Triton's interpreter (``TRITON_INTERPRET=1`` at import)."""
    return not isinstance(_store_kv_kernel, JITFunction)


def _check_attention_inputs(q: Tensor, k_cache: Tensor, v_cache: Tensor, k_scales=None, v_scales=None) -> int:
    """Shared invariants of the attention launchers; returns query heads per KV head."""
    assert q.dim() == 3 and k_cache.dim() == 4, "q is [tokens, heads, dim], caches are [blocks, bs, kvh, dim]"
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    if k_scales is None:
        assert q.dtype == k_cache.dtype == v_cache.dtype
    else:  # a quantized cache: a float32 scale per token and KV head, dequantized in the kernel
        assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (torch.int8, torch.float8_e4m3fn)
        assert v_scales is not None and k_scales.dtype == v_scales.dtype == torch.float32
        assert k_scales.shape == v_scales.shape == k_cache.shape[:3]
        assert k_scales.stride() == v_scales.stride()
    assert q.dtype in (torch.float32, torch.float16, torch.bfloat16), f"unsupported dtype {q.dtype}"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1, "head dim must be contiguous"
    assert q.shape[2] == k_cache.shape[3], "q and cache head dims differ"
    assert q.shape[1] % k_cache.shape[2] == 0, "num_heads must be a multiple of num_kv_heads"
    assert q.is_cuda or is_interpreted(), "Triton kernels need CUDA tensors (or TRITON_INTERPRET=1)"
    return q.shape[1] // k_cache.shape[2]


def _upcast_dot(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and is_interpreted()


def _scale_args(k_scales: Tensor | None, v_scales: Tensor | None, q: Tensor) -> tuple:
    """(k scale ptr, v scale ptr, block stride, token stride, head stride); q stands in when not
    quantized."""
    if k_scales is None:
        return q, q, 0, 0, 0
    return k_scales, v_scales, k_scales.stride(0), k_scales.stride(1), k_scales.stride(2)


@triton.jit
def _dequant(x, scales, mask, dtype, QUANT: tl.constexpr):
    """Tile rows of a quantized cache times their token's scale for this KV head (``scales``: a
    pointer per row), in ``dtype``."""
    if QUANT:
        s = tl.load(scales, mask=mask, other=0.0)
        x = (x.to(tl.float32) * s[:, None]).to(dtype)
    return x


# --- store_kv ---------------------------------------------------------------------------------------


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, blocks_ptr, offsets_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    block = tl.load(blocks_ptr + t)
    offset = tl.load(offsets_ptr + t)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    dst = block * stride_cb + offset * stride_cs + h * stride_ch + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(
    k: Tensor,  # [T, num_kv_heads, head_dim]
    v: Tensor,
    k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], strided
    v_cache: Tensor,
    slot_blocks: Tensor,  # [T] int64
    slot_offsets: Tensor,  # [T] int64
) -> None:
    t, kvh, d = k.shape
    assert v.shape == k.shape and k.dtype == v.dtype == k_cache.dtype == v_cache.dtype
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.dim() == 4 and tuple(k_cache.shape[2:]) == (kvh, d), "cache is [blocks, bs, kvh, dim]"
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1, "head dim must be contiguous"
    assert slot_blocks.shape == slot_offsets.shape == (t,)
    assert slot_blocks.dtype == slot_offsets.dtype == torch.int64
    assert slot_blocks.is_contiguous() and slot_offsets.is_contiguous()
    assert k.is_cuda or is_interpreted(), "Triton kernels need CUDA tensors (or TRITON_INTERPRET=1)"
    if t == 0:
        return
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_blocks, slot_offsets,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=kvh, HEAD_DIM=d, BLOCK_H=triton.next_power_of_2(kvh), BLOCK_D=triton.next_power_of_2(d),
    )  # fmt: skip


def store_kv_ref(
    k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_blocks: Tensor, slot_offsets: Tensor
) -> None:
    k_cache[slot_blocks, slot_offsets] = k
    v_cache[slot_blocks, slot_offsets] = v


# --- paged_decode_attention -------------------------------------------------------------------------


@triton.jit
def _decode_partition_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, seq_lens_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    k_scale_ptr, v_scale_ptr, qk_scale, num_heads, num_partitions,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_cb, stride_cs, stride_ch, stride_tb, stride_sb, stride_ss, stride_sh,
    QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, WINDOW: tl.constexpr,
    PARTITION_SIZE: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr, QUANT: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, TILE_N: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = part * PARTITION_SIZE
    end = tl.minimum(start + PARTITION_SIZE, seq_len)
    lo = start
    if WINDOW > 0:
        # NOTE: start is a multiple of TILE_N, so the rounded-down window start stays tile-aligned.
        lo = tl.maximum(start, tl.maximum(seq_len - WINDOW, 0) // TILE_N * TILE_N)
    if lo >= end:  # past the context or before the window: the reduction skips this partition
        return

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    head = kvh * QUERIES_PER_KV + g
    row_mask = (g < QUERIES_PER_KV)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + d[None, :], mask=row_mask, other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(lo, end, TILE_N):
        pos = tile + tl.arange(0, TILE_N)
        valid = pos < end
        if WINDOW > 0:
            valid &= pos >= seq_len - WINDOW
        block = tl.load(tables_ptr + b * stride_tb + pos // PAGE_SIZE, mask=valid, other=0)
        slot = block * stride_cb + (pos % PAGE_SIZE) * stride_cs + kvh * stride_ch
        scale_at = block * stride_sb + (pos % PAGE_SIZE) * stride_ss + kvh * stride_sh  # (QUANT)
        kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
        k = _dequant(k, k_scale_ptr + scale_at, valid, q.dtype, QUANT)
        s = _dot(q, tl.trans(k), UPCAST) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        # Every tile holds a visible key (lo is the window's tile), so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = _dequant(v, v_scale_ptr + scale_at, valid, q.dtype, QUANT)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new

    if SPLIT:
        idx = ((b * num_heads + head) * num_partitions + part).to(tl.int64)
        tl.store(part_m_ptr + idx, m_i, mask=g < QUERIES_PER_KV)
        tl.store(part_l_ptr + idx, l_i, mask=g < QUERIES_PER_KV)
        tl.store(part_acc_ptr + idx[:, None] * BLOCK_D + d[None, :], acc, mask=row_mask)
    else:
        out = acc / l_i[:, None]
        dst = out_ptr + b * stride_ob + head[:, None] * stride_oh + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _decode_reduce_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, seq_lens_ptr, out_ptr,
    num_heads, num_partitions, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, PARTITION_SIZE: tl.constexpr, WINDOW: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    first = 0
    if WINDOW > 0:
        first = tl.maximum(seq_len - WINDOW, 0) // PARTITION_SIZE
    last = tl.cdiv(seq_len, PARTITION_SIZE)
    d = tl.arange(0, BLOCK_D)
    base = ((b * num_heads + h) * num_partitions).to(tl.int64)
    # Start from the first written partition so the running max is never -inf.
    m = tl.load(part_m_ptr + base + first)
    l_sum = tl.load(part_l_ptr + base + first)
    acc = tl.load(part_acc_ptr + (base + first) * BLOCK_D + d)
    for p in range(first + 1, last):
        m_p = tl.load(part_m_ptr + base + p)
        m_new = tl.maximum(m, m_p)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(m_p - m_new)
        l_sum = l_sum * alpha + tl.load(part_l_ptr + base + p) * beta
        acc = acc * alpha + tl.load(part_acc_ptr + (base + p) * BLOCK_D + d) * beta
        m = m_new
    out = acc / l_sum
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_decode_attention(
    q: Tensor,  # [B, num_heads, head_dim]
    k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], strided
    v_cache: Tensor,
    block_tables: Tensor,  # [B, max_blocks] int64
    seq_lens: Tensor,  # [B] int64, context length including the query token
    max_seq_len: int,  # host-side max of seq_lens (sizes the split without a device sync)
    scale: float,
    sliding_window: int | None = None,
    out: Tensor | None = None,
    partition_size: int = 512,
    k_scales: Tensor
    | None = None,  # [num_blocks, block_size, num_kv_heads] float32: a quantized cache's scales
    v_scales: Tensor | None = None,
) -> Tensor:
    qpk = _check_attention_inputs(q, k_cache, v_cache, k_scales, v_scales)
    batch, num_heads, head_dim = q.shape
    assert block_tables.dim() == 2 and block_tables.shape[0] == batch and block_tables.stride(1) == 1
    assert block_tables.dtype == seq_lens.dtype == torch.int64 and seq_lens.shape == (batch,)
    assert seq_lens.is_contiguous()
    assert block_tables.shape[1] * k_cache.shape[1] >= max_seq_len, "block tables too short for max_seq_len"
    assert partition_size > 0 and partition_size % DECODE_TILE == 0, f"not a multiple of {DECODE_TILE}"
    assert sliding_window is None or sliding_window > 0
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if batch == 0:
        return out
    num_partitions = triton.cdiv(max_seq_len, partition_size)
    block_d = triton.next_power_of_2(head_dim)
    split = num_partitions > 1
    part_m = part_l = part_acc = out  # unused placeholders when not split
    if split:
        part_m = torch.empty((batch, num_heads, num_partitions), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((*part_m.shape, block_d), dtype=torch.float32, device=q.device)
    window = sliding_window or 0
    scales = _scale_args(k_scales, v_scales, q)
    _decode_partition_kernel[(batch, k_cache.shape[2], num_partitions)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_m, part_l, part_acc,
        *scales[:2], scale * LOG2E, num_heads, num_partitions,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), *scales[2:],
        QUERIES_PER_KV=qpk, HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1], WINDOW=window,
        PARTITION_SIZE=partition_size, SPLIT=split, UPCAST=_upcast_dot(q.dtype), QUANT=k_scales is not None,
        BLOCK_G=max(16, triton.next_power_of_2(qpk)), BLOCK_D=block_d, TILE_N=DECODE_TILE,
    )  # fmt: skip
    if split:
        _decode_reduce_kernel[(batch, num_heads)](
            part_m, part_l, part_acc, seq_lens, out, num_heads, num_partitions, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, PARTITION_SIZE=partition_size, WINDOW=window, BLOCK_D=block_d,
        )  # fmt: skip
    return out


def _context_ref(cache: Tensor, table: Tensor, ctx: int) -> Tensor:
    """The first ``ctx`` tokens of a sequence's paged K or V: ``[ctx, num_kv_heads, head_dim]``."""
    num_blocks = -(-ctx // cache.shape[1])
    return cache[table[:num_blocks]].flatten(0, 1)[:ctx]


def _attention_ref(
    q: Tensor, keys: Tensor, values: Tensor, q_pos: Tensor, scale: float, sliding_window: int | None
) -> Tensor:
    """Float32 softmax attention of ``q`` [n, H, D] at ``q_pos`` [n] over keys at positions 0..ctx-1."""
    group = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    k_pos = torch.arange(keys.shape[0], device=q.device)
    visible = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def paged_decode_attention_ref(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> Tensor:
    out = torch.empty_like(q)
    for i, ctx in enumerate(seq_lens.tolist()):
        keys = _context_ref(k_cache, block_tables[i], ctx)
        values = _context_ref(v_cache, block_tables[i], ctx)
        q_pos = torch.tensor([ctx - 1], device=q.device)
        out[i] = _attention_ref(q[i : i + 1], keys, values, q_pos, scale, sliding_window)[0]
    return out
