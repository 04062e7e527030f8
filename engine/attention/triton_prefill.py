"""Triton varlen prefill attention over the paged KV cache, next to its torch oracle.

``paged_prefill_attention``: varlen query chunks; chunk ``s`` holds the queries at positions
``seq_len - q_len .. seq_len - 1`` and attends causally over the paged context, which already holds
the chunk (chunked prefill and prefix-cache hits are the same case). Grid ``(cdiv(max_q_len,
BLOCK_Q), B, num_kv_heads)``; a program's ``BLOCK_M`` rows are ``BLOCK_Q`` tokens × the KV head's
query heads, so any query-per-KV ratio fits. Layout, accumulation and masking as in
``triton_kernels`` (whose shared helpers it uses).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.attention.triton_kernels import (
    LOG2E,
    _attention_ref,
    _check_attention_inputs,
    _context_ref,
    _dequant,
    _dot,
    _scale_args,
    _upcast_dot,
)

PREFILL_BLOCK_M = 64  # query rows (tokens × query heads of one KV head) per prefill program
PREFILL_TILE = 32


# --- paged_prefill_attention ------------------------------------------------------------------------


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, query_start_ptr, seq_lens_ptr, out_ptr,
    k_scale_ptr, v_scale_ptr, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_tb, stride_sb, stride_ss, stride_sh,
    QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, WINDOW: tl.constexpr,
    UPCAST: tl.constexpr, QUANT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
):  # fmt: skip
    q_block = tl.program_id(0)
    seq = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_q_pos = seq_len - q_len + q_block * BLOCK_Q

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    tok = q_block * BLOCK_Q + r // QUERIES_PER_KV
    head = kvh * QUERIES_PER_KV + r % QUERIES_PER_KV
    row_mask = ((r < BLOCK_Q * QUERIES_PER_KV) & (tok < q_len))[:, None] & (d < HEAD_DIM)[None, :]
    q_pos = seq_len - q_len + tok
    q_off = (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_mask, other=0.0)

    hi = tl.minimum(seq_len, first_q_pos + BLOCK_Q)  # one past this block's last query position
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(first_q_pos - WINDOW + 1, 0) // TILE_N * TILE_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for tile in range(lo, hi, TILE_N):
        pos = tile + tl.arange(0, TILE_N)
        in_ctx = pos < hi
        block = tl.load(tables_ptr + seq * stride_tb + pos // PAGE_SIZE, mask=in_ctx, other=0)
        slot = block * stride_cb + (pos % PAGE_SIZE) * stride_cs + kvh * stride_ch
        scale_at = block * stride_sb + (pos % PAGE_SIZE) * stride_ss + kvh * stride_sh  # (QUANT)
        kv_mask = in_ctx[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
        k = _dequant(k, k_scale_ptr + scale_at, in_ctx, q.dtype, QUANT)
        s = _dot(q, tl.trans(k), UPCAST) * qk_scale
        visible = in_ctx[None, :] & (pos[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            visible &= pos[None, :] > q_pos[:, None] - WINDOW
        s = tl.where(visible, s, float("-inf"))
        # A row may see nothing in this tile (causal / window edge): keep exp2 away from -inf - -inf.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = _dequant(v, v_scale_ptr + scale_at, in_ctx, q.dtype, QUANT)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l_i == 0 only on padding rows
    dst = out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask)


def paged_prefill_attention(
    q: Tensor,  # [T, num_heads, head_dim], the chunks back to back
    k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], strided; holds the chunks
    v_cache: Tensor,
    block_tables: Tensor,  # [B, max_blocks] int64
    query_start_loc: Tensor,  # [B + 1] int64, offsets into q
    seq_lens: Tensor,  # [B] int64, context length after the chunk
    max_query_len: int,  # host-side max chunk length (sizes the grid without a device sync)
    scale: float,
    sliding_window: int | None = None,
    out: Tensor | None = None,
    k_scales: Tensor
    | None = None,  # [num_blocks, block_size, num_kv_heads] float32: a quantized cache's scales
    v_scales: Tensor | None = None,
) -> Tensor:
    qpk = _check_attention_inputs(q, k_cache, v_cache, k_scales, v_scales)
    batch = seq_lens.shape[0]
    assert block_tables.dim() == 2 and block_tables.shape[0] == batch and block_tables.stride(1) == 1
    assert query_start_loc.shape == (batch + 1,) and query_start_loc.is_contiguous()
    assert seq_lens.is_contiguous()
    assert block_tables.dtype == query_start_loc.dtype == seq_lens.dtype == torch.int64
    assert sliding_window is None or sliding_window > 0
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if batch == 0 or max_query_len == 0:
        return out
    block_m = max(PREFILL_BLOCK_M, triton.next_power_of_2(qpk))
    block_q = block_m // qpk
    grid = (triton.cdiv(max_query_len, block_q), batch, k_cache.shape[2])
    scales = _scale_args(k_scales, v_scales, q)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, *scales[:2], scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), *scales[2:],
        QUERIES_PER_KV=qpk, HEAD_DIM=q.shape[2], PAGE_SIZE=k_cache.shape[1], WINDOW=sliding_window or 0,
        UPCAST=_upcast_dot(q.dtype), QUANT=k_scales is not None, BLOCK_M=block_m, BLOCK_Q=block_q,
        BLOCK_D=triton.next_power_of_2(q.shape[2]), TILE_N=PREFILL_TILE,
    )  # fmt: skip
    return out


def paged_prefill_attention_ref(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> Tensor:
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for i, ctx in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        keys = _context_ref(k_cache, block_tables[i], ctx)
        values = _context_ref(v_cache, block_tables[i], ctx)
        q_pos = torch.arange(ctx - (end - start), ctx, device=q.device)
        out[start:end] = _attention_ref(q[start:end], keys, values, q_pos, scale, sliding_window)
    return out
