"""Fused Triton kernels for the Llama family's small ops on the GPU, each next to its torch reference.

The GPU profile (bench/README.md, "GPU (H100)") shows a decode step spending ~340 small kernels outside
the matmuls and attention: RMSNorm as float32 upcast, square, mean, rsqrt, multiply, downcast and weight
multiply; rotary via slice, neg, cat, two multiplies and an add per tensor; the residual adds; SiLU and
the gate-up multiply; and the dtype copies between them. Each is memory bound and tiny at decode batch
sizes, so launches dominate. One kernel each here:

- ``rms_norm``: RMSNorm over the last dim (rows of ``[T, D]`` or ``[T, H, D]``, e.g. Qwen3's q/k norm).
- ``add_rms_norm``: the decoder layer's ``x = x + residual; h = norm(x)``; returns ``(h, x)``.
- ``rotary``: rotate-half rotary embedding of q and k in one launch, from ``RotaryEmbedding.lookup``.
- ``silu_mul``: ``silu(gate) * up`` from the fused ``gate_up`` projection output ``[T, 2 * I]``.

Semantics follow ``engine/models/llama.py``: RMSNorm computes in float32, rounds the normalised value to
the input dtype, then multiplies by the weight (as ``weight * x.to(dtype)`` does); rotary and SiLU
compute in float32 and round once. Launch paths read only shapes and strides (no host syncs), so they
are CUDA-graph capturable. The model picks these on CUDA tensors; the tests force them on CPU tensors
under Triton's interpreter (``TRITON_INTERPRET=1``, set before this module is imported).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor


def _num_warps(block: int) -> int:
    return min(max(block // 256, 1), 8)


def _rows(x: Tensor) -> tuple[int, int, int, int]:
    """``x`` as rows of its last dim: (outer count, inner count, outer stride, inner stride)."""
    assert x.dim() in (2, 3) and x.stride(-1) == 1, "rows of [T, D] or [T, H, D] with a contiguous last dim"
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    return x.shape[0], x.shape[1], x.stride(0), x.stride(1)


# --- RMSNorm, optionally fused with the residual add ------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    inner, stride_xo, stride_xi, stride_ro, stride_ri, D, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)  # NOTE: row offsets of long prefills overflow int32
    o, i = row // inner, row % inner
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + o * stride_xo + i * stride_xi + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:  # the sum rounds to the input dtype, as torch's ``x + residual`` does
        r = tl.load(res_ptr + o * stride_ro + i * stride_ri + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * D + cols, x, mask=mask)
        x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def _launch_rms_norm(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor | None]:
    assert weight.dim() == 1 and weight.shape[0] == x.shape[-1] and weight.is_contiguous()
    outer, inner, sxo, sxi = _rows(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out, sro, sri = None, 0, 0
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        _, _, sro, sri = _rows(residual)
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    d = x.shape[-1]
    if out.numel() == 0:
        return out, res_out
    block = triton.next_power_of_2(d)
    _rms_norm_kernel[(outer * inner,)](
        x, residual if residual is not None else x, weight, out, res_out if res_out is not None else out,
        inner, sxo, sxi, sro, sri, d, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_num_warps(block),
    )  # fmt: skip
    return out, res_out


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim of ``[T, D]`` or ``[T, H, D]``; a new contiguous tensor."""
    return _launch_rms_norm(x, None, weight, eps)[0]


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``s = x + residual``; returns ``(rms_norm(s), s)``."""
    out, res_out = _launch_rms_norm(x, residual, weight, eps)
    return out, res_out


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm_ref(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    s = x + residual
    return rms_norm_ref(s, weight, eps), s


# --- Rotary embedding (rotate-half) of q and k --------------------------------------------------------


@triton.jit
def _rotate_heads(
    src_ptr, dst_ptr, t, stride_t, stride_h, H, c, s, HALF, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr
):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < H) & (d < HALF)
    src = src_ptr + t * stride_t + h * stride_h + d
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = dst_ptr + (t * H + h) * (2 * HALF) + d
    tl.store(dst, (x1 * c - x2 * s).to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * c + x1 * s).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st, HQ, HK, HALF,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)[None, :]
    # NOTE: the lookup's rows are cat(freqs, freqs), so the first half of each row holds every angle.
    c = tl.load(cos_ptr + t * stride_ct + d, mask=d < HALF, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_st + d, mask=d < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, t, stride_qt, stride_qh, HQ, c, s, HALF, BLOCK_HQ, BLOCK_D)
    _rotate_heads(k_ptr, k_out_ptr, t, stride_kt, stride_kh, HK, c, s, HALF, BLOCK_HK, BLOCK_D)


def rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """q: [T, H, D], k: [T, KVH, D] (last dim contiguous); cos/sin: [T, 1, D] rows of cat(freqs, freqs).

    Returns new contiguous q and k, as the torch path does (the attention backends take them as is).
    """
    t, hq, d = q.shape
    hk = k.shape[1]
    assert k.shape == (t, hk, d) and q.stride(-1) == k.stride(-1) == 1 and d % 2 == 0
    assert cos.shape == sin.shape == (t, 1, d) and cos.stride(-1) == sin.stride(-1) == 1
    q_out, k_out = (
        torch.empty(q.shape, dtype=q.dtype, device=q.device),
        torch.empty_like(k, memory_format=torch.contiguous_format),
    )
    if t == 0:
        return q_out, k_out
    block_d = triton.next_power_of_2(d // 2)
    _rotary_kernel[(t,)](
        q, k, cos, sin, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0), hq, hk, d // 2,
        BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HK=triton.next_power_of_2(hk), BLOCK_D=block_d,
        num_warps=_num_warps(triton.next_power_of_2(hq) * block_d),
    )  # fmt: skip
    return q_out, k_out


def rotary_ref(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    def rotate(x: Tensor) -> Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    return rotate(q), rotate(k)


# --- SiLU(gate) * up ------------------------------------------------------------------------------------


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: Tensor) -> Tensor:
    """``gate_up``: [T, 2 * I], gate first (``MLP.gate_up_proj``'s layout); returns ``silu(gate) * up``, [T, I]."""
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and gate_up.stride(1) == 1
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = min(triton.next_power_of_2(inter), 1024)
    _silu_mul_kernel[(t, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), inter, BLOCK=block, num_warps=4
    )
    return out


def silu_mul_ref(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up
