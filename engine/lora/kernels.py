"""The batched low-rank update in Triton (the GPU engine's; ``engine.lora.batch.lora_update_ref`` is
its torch reference and the CPU engine's). It works on *tiles*:
runs of up to ``tile`` consecutive tokens of one adapter (a prefill chunk is one run; decodes of one
adapter next to each other share one). A tile's program multiplies its tokens by the slot's A in one
``tl.dot`` (shrink, into a float32 ``[T, N]`` buffer), then by its B and adds into ``y`` (expand):
the segmented-GEMM scheme of Punica / S-LoRA. Base-model tokens belong to no tile and cost nothing.
Slot tensors: ``A`` ``[slots, K, N]`` (``N``: the stacked ranks of a fused projection's parts) and a
``B`` ``[slots, R, O_i]`` per part, whose expand writes the part's own output columns
(``engine.lora.slots``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, xa_ptr, tile_start_ptr, tile_len_ptr, tile_slot_ptr,
    K, N, stride_x, stride_as, stride_ak, stride_xa,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    start = tl.load(tile_start_ptr + tile)
    length = tl.load(tile_len_ptr + tile)
    slot = tl.load(tile_slot_ptr + tile)
    t = tl.arange(0, BLOCK_T)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(
            x_ptr + (start + t)[:, None] * stride_x + k[None, :],
            mask=(t[:, None] < length) & (k[None, :] < K),
            other=0.0,
        )
        at = tl.load(
            a_ptr + slot * stride_as + k[:, None] * stride_ak + n[None, :],
            mask=(n[None, :] < N) & (k[:, None] < K),
            other=0.0,
        )
        acc += tl.dot(xt.to(tl.float32), at.to(tl.float32))
    tl.store(
        xa_ptr + (start + t)[:, None] * stride_xa + n[None, :],
        acc,
        mask=(t[:, None] < length) & (n[None, :] < N),
    )


@triton.jit
def _expand_kernel(
    xa_ptr, b_ptr, y_ptr, tile_start_ptr, tile_len_ptr, tile_slot_ptr,
    N, OUT, stride_xa, stride_bs, stride_bn, stride_y,
    BLOCK_T: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    start = tl.load(tile_start_ptr + tile)
    length = tl.load(tile_len_ptr + tile)
    slot = tl.load(tile_slot_ptr + tile)
    t = tl.arange(0, BLOCK_T)
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    acc = tl.zeros((BLOCK_T, BLOCK_O), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        xat = tl.load(
            xa_ptr + (start + t)[:, None] * stride_xa + n[None, :],
            mask=(t[:, None] < length) & (n[None, :] < N),
            other=0.0,
        )
        bt = tl.load(
            b_ptr + slot * stride_bs + n[:, None] * stride_bn + o[None, :],
            mask=(o[None, :] < OUT) & (n[:, None] < N),
            other=0.0,
        )
        acc += tl.dot(xat, bt.to(tl.float32))
    mask = (t[:, None] < length) & (o[None, :] < OUT)
    y_ptrs = y_ptr + (start + t)[:, None] * stride_y + o[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


def lora_update(
    y: torch.Tensor,
    x: torch.Tensor,
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    a: torch.Tensor,
    parts,
    tile: int,
) -> None:
    """``y += delta`` in place over ``tiles`` = (starts, lengths, slots) on the device, each at most
    ``tile`` tokens long (``engine.lora.batch.make_tiles``, ``TILE``: a power of two >= 16); ``a``
    ``[slots, K, P * R]``, ``parts``: P ``(b [slots, R, O_i], lo, hi)`` (one shrink, one expand per part
    into its output columns)."""
    starts, lengths, slots = tiles
    num_tiles = starts.shape[0]
    if num_tiles == 0:
        return
    assert x.stride(1) == 1 and y.stride(1) == 1 and a.stride(2) == 1
    k, n = x.shape[1], a.shape[2]
    r = n // len(parts)
    xa = torch.empty((x.shape[0], n), dtype=torch.float32, device=x.device)
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    _shrink_kernel[(num_tiles, triton.cdiv(n, block_n))](
        x, a, xa, starts, lengths, slots, k, n, x.stride(0), a.stride(0), a.stride(1), xa.stride(0),
        BLOCK_T=tile, BLOCK_N=block_n, BLOCK_K=64,
    )  # fmt: skip
    block_r = max(16, min(64, triton.next_power_of_2(r)))
    for i, (b, lo, hi) in enumerate(parts):
        assert b.stride(2) == 1
        xa_i, y_i = xa[:, i * r : (i + 1) * r], y[:, lo:hi]
        _expand_kernel[(num_tiles, triton.cdiv(hi - lo, 64))](
            xa_i, b, y_i, starts, lengths, slots, r, hi - lo, xa_i.stride(0), b.stride(0), b.stride(1),
            y_i.stride(0), BLOCK_T=tile, BLOCK_O=64, BLOCK_N=block_r,
        )  # fmt: skip


# One program per token (and block of output columns) for a decode step replayed from a CUDA graph:
# the grid is the graph's batch size, the slots a static device buffer the graph reads (-1: a
# base-model or padding row, which the programs leave untouched), so nothing about the step's mix of
# adapters is baked into the graph (the per-token gather of Punica's BGMV).


@triton.jit
def _shrink_token_kernel(
    x_ptr, a_ptr, xa_ptr, slot_ptr, K, N, stride_x, stride_as, stride_ak, stride_xa,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    s = tl.where(slot >= 0, slot, 0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_in = (k < K) & (k * 0 + slot >= 0)  # NOTE: a vector mask (the interpreter takes no scalar)
        xk = tl.load(x_ptr + t * stride_x + k, mask=k_in, other=0.0)
        at = tl.load(
            a_ptr + s * stride_as + k[:, None] * stride_ak + n[None, :],
            mask=k_in[:, None] & (n[None, :] < N),
            other=0.0,
        )
        acc += tl.sum(xk.to(tl.float32)[:, None] * at.to(tl.float32), axis=0)
    tl.store(xa_ptr + t * stride_xa + n, acc, mask=n < N)


@triton.jit
def _expand_token_kernel(
    xa_ptr, b_ptr, y_ptr, slot_ptr, N, OUT, stride_xa, stride_bs, stride_bn, stride_y,
    BLOCK_O: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    s = tl.where(slot >= 0, slot, 0)
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    acc = tl.zeros((BLOCK_O,), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_in = (n < N) & (n * 0 + slot >= 0)
        xan = tl.load(xa_ptr + t * stride_xa + n, mask=n_in, other=0.0)
        bt = tl.load(
            b_ptr + s * stride_bs + n[:, None] * stride_bn + o[None, :],
            mask=n_in[:, None] & (o[None, :] < OUT),
            other=0.0,
        )
        acc += tl.sum(xan[:, None] * bt.to(tl.float32), axis=0)
    mask = (o < OUT) & (o * 0 + slot >= 0)
    y_ptrs = y_ptr + t * stride_y + o
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


def lora_update_per_token(
    y: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor, a: torch.Tensor, parts
) -> None:
    """``y += delta`` in place, one program per token of ``token_slots`` (``[T]`` on the device, -1:
    no update): shapes and launches depend on nothing but ``T``, so a CUDA graph can capture it.
    ``a`` and ``parts`` as in ``lora_update``."""
    assert x.stride(1) == 1 and y.stride(1) == 1 and a.stride(2) == 1
    t, k, n = x.shape[0], x.shape[1], a.shape[2]
    if t == 0:
        return
    r = n // len(parts)
    xa = torch.empty((t, n), dtype=torch.float32, device=x.device)
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    _shrink_token_kernel[(t, triton.cdiv(n, block_n))](
        x, a, xa, token_slots, k, n, x.stride(0), a.stride(0), a.stride(1), xa.stride(0),
        BLOCK_N=block_n, BLOCK_K=64,
    )  # fmt: skip
    block_r = max(16, min(64, triton.next_power_of_2(r)))
    for i, (b, lo, hi) in enumerate(parts):
        assert b.stride(2) == 1
        xa_i, y_i = xa[:, i * r : (i + 1) * r], y[:, lo:hi]
        _expand_token_kernel[(t, triton.cdiv(hi - lo, 128))](
            xa_i, b, y_i, token_slots, r, hi - lo, xa_i.stride(0), b.stride(0), b.stride(1), y_i.stride(0),
            BLOCK_O=128, BLOCK_N=block_r,
        )  # fmt: skip
