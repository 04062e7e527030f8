"""Triton paged-attention kernels against their torch references; the Triton backend against the torch one.

NOTE: ``TRITON_INTERPRET=1`` is set below, before the kernels module is imported: ``@triton.jit`` picks
the interpreter or the compiler when a kernel is *defined*, so it must precede that import (importing
torch does not import triton). It is set only without CUDA, so on the CPU tier the kernels run in
Triton's interpreter on CPU tensors, while on a GPU machine the same matrix runs compiled on CUDA and
the rest of the session keeps compiled kernels. An explicit ``TRITON_INTERPRET`` wins either way.

Caches are poisoned with NaN outside every sequence's context (padding table entries point at a
poisoned block too), so a kernel that reads a slot it should mask fails loudly.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import triton

from engine.attention import triton_kernels as tk
from engine.attention import triton_prefill as tp
from engine.attention.backend import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.triton_backend import TritonAttentionBackend
from engine.kv_quant import QuantizedKVCache, store

INTERPRETED = tk.is_interpreted()
assert triton.knobs.runtime.interpret == INTERPRETED, "triton_kernels was defined before the env was set"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA GPU", allow_module_level=True)
DEVICE = "cpu" if INTERPRETED else "cuda"

KV_HEADS = 2
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {  # (atol, rtol); the references compute in float32 from the same rounded inputs
    torch.float32: (1e-5, 1e-5),
    torch.float16: (5e-3, 1e-2),
    torch.bfloat16: (3e-2, 3e-2),
}
# (block size, head dim, query heads per KV head): each value of each axis appears with several others.
GEOMETRIES = [(4, 64, 1), (8, 128, 2), (16, 64, 4), (4, 128, 8), (16, 128, 1), (8, 64, 8)]
WINDOW = 24


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    atol, rtol = TOL[out.dtype]
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=atol, rtol=rtol)


def _paged_cache(ctx_lens: list[int], block_size: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    """A 2-layer cache holding ``ctx_lens`` tokens in scattered blocks, NaN everywhere else."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in ctx_lens]
    num_blocks = sum(per_seq) + 3  # block 0 (table padding) and two spares are never allocated
    ids = (1 + torch.randperm(num_blocks - 1, generator=gen)).tolist()
    tables = torch.zeros((len(ctx_lens), max(per_seq)), dtype=torch.int64)
    used = torch.zeros((num_blocks, block_size), dtype=torch.bool)
    for i, (n, nb) in enumerate(zip(ctx_lens, per_seq)):
        blocks, ids = ids[:nb], ids[nb:]
        tables[i, :nb] = torch.tensor(blocks)
        slots = torch.tensor(blocks)[:, None] * block_size + torch.arange(block_size)
        used.view(-1)[slots.view(-1)[:n]] = True
    kv = torch.randn((num_blocks, 2, 2, block_size, KV_HEADS, head_dim), generator=gen)
    kv = kv.masked_fill(~used[:, None, None, :, None, None], float("nan"))
    return kv.to(dtype).to(DEVICE), tables.to(DEVICE)


def _queries(n: int, qpk: int, head_dim: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((n, KV_HEADS * qpk, head_dim), generator=gen).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_store_kv_writes_slots_of_one_layer(block_size: int, dtype: torch.dtype) -> None:
    kv, _ = _paged_cache([30], block_size, 64, dtype)
    kv = torch.nan_to_num(kv)
    ref = kv.clone()
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn((11, 3 * KV_HEADS, 64), generator=gen).to(dtype).to(DEVICE)
    k, v = qkv[:, KV_HEADS : 2 * KV_HEADS], qkv[:, 2 * KV_HEADS :]  # strided views, as after a fused qkv
    slots = torch.randperm(kv.shape[0] * block_size, generator=gen)[:11].to(DEVICE)
    blocks, offsets = slots // block_size, slots % block_size
    tk.store_kv(k, v, kv[:, 1, 0], kv[:, 1, 1], blocks, offsets)
    tk.store_kv_ref(k, v, ref[:, 1, 0], ref[:, 1, 1], blocks, offsets)
    assert torch.equal(kv, ref)  # exact copy, and layer 0 untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "bs{}-hd{}-gqa{}".format(*g))
def test_decode_split_k_matches_reference(geometry, window: int | None, dtype: torch.dtype) -> None:
    block_size, head_dim, qpk = geometry
    lens = [150, 97, 33, 16, 5, 1]  # 150: three partitions of 64; 33, 5 and 1 end mid-block
    partition = 64
    assert triton.cdiv(max(lens), partition) == 3
    kv, tables = _paged_cache(lens, block_size, head_dim, dtype)
    q = _queries(len(lens), qpk, head_dim, dtype)
    seq_lens = torch.tensor(lens, device=DEVICE)
    args = (q, kv[:, 1, 0], kv[:, 1, 1], tables, seq_lens)
    scale = head_dim**-0.5
    out = tk.paged_decode_attention(*args, max(lens), scale, window, partition_size=partition)
    _close(out, tk.paged_decode_attention_ref(*args, scale, window))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, WINDOW])
def test_decode_single_partition_matches_reference(window: int | None, dtype: torch.dtype) -> None:
    lens = [90, 41, 3]
    kv, tables = _paged_cache(lens, 16, 128, dtype)
    q = _queries(len(lens), 4, 128, dtype)
    args = (q, kv[:, 1, 0], kv[:, 1, 1], tables, torch.tensor(lens, device=DEVICE))
    out = tk.paged_decode_attention(*args, max(lens), 0.1, window)  # default partition: one, no reduction
    _close(out, tk.paged_decode_attention_ref(*args, 0.1, window))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "bs{}-hd{}-gqa{}".format(*g))
def test_prefill_chunks_match_reference(geometry, window: int | None, dtype: torch.dtype) -> None:
    block_size, head_dim, qpk = geometry
    # (context after the chunk, chunk length): fresh prompts, chunks over a cached prefix, a 1-token chunk.
    chunks = [(7, 7), (40, 40), (100, 30), (33, 1), (64, 17)]
    lens = [c for c, _ in chunks]
    kv, tables = _paged_cache(lens, block_size, head_dim, dtype)
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    q = _queries(starts[-1], qpk, head_dim, dtype)
    query_start = torch.tensor(starts, device=DEVICE)
    args = (q, kv[:, 1, 0], kv[:, 1, 1], tables, query_start, torch.tensor(lens, device=DEVICE))
    scale = head_dim**-0.5
    out = tp.paged_prefill_attention(*args, max(n for _, n in chunks), scale, window)
    _close(out, tp.paged_prefill_attention_ref(*args, scale, window))


def _runner_meta(
    seqs: list[tuple[int, int]], block_ids: list[list[int]], block_size: int, device: str
) -> AttentionMetadata:
    """AttentionMetadata for ``(computed, scheduled)`` sequences, built the way ModelRunner._prepare does."""
    seq_lens = [c + n for c, n in seqs]
    qsl = [0]
    for _, n in seqs:
        qsl.append(qsl[-1] + n)
    tables = torch.zeros((len(seqs), max(-(-s // block_size) for s in seq_lens)), dtype=torch.int64)
    for i, ids in enumerate(block_ids):
        tables[i, : len(ids)] = torch.tensor(ids)
    pos = torch.cat([torch.arange(c, c + n) for c, n in seqs])
    q_seq = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor([n for _, n in seqs]))
    return AttentionMetadata(
        num_decodes=sum(n == 1 for _, n in seqs),
        slot_blocks=tables[q_seq, pos // block_size].to(device),
        slot_offsets=(pos % block_size).to(device),
        seq_lens=torch.tensor(seq_lens, device=device),
        seq_lens_list=seq_lens,
        query_start_loc=qsl,
        block_tables=tables.to(device),
        block_size=block_size,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [None, 16])
def test_backend_matches_torch_backend_on_mixed_batch(window: int | None, dtype: torch.dtype) -> None:
    # (computed, scheduled): decodes first, longest first (as the runner orders them), then a chunk of a
    # long prompt and a prompt whose first two blocks are a prefix-cache hit on that prompt's blocks.
    _compare_backends([(69, 1), (32, 1), (8, 1), (0, 1), (37, 20), (16, 11)], window, dtype, share=(4, 5))


@pytest.mark.parametrize("window", [None, 16])
def test_backend_matches_torch_backend_on_speculative_verification(window: int | None) -> None:
    """Speculative decoding's verify step: decodes, then each speculating sequence's last token and
    its k drafts as a short chunk over a long paged prefix (crossing a block boundary, or not)."""
    _compare_backends([(40, 1), (9, 1), (69, 5), (30, 3), (21, 5), (7, 2)], window, torch.float32)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backend_matches_torch_backend_on_a_quantized_cache(
    kv_dtype: torch.dtype, dtype: torch.dtype
) -> None:
    """int8 / e4m3 blocks with a scale per token and KV head: the kernels dequantize them as the torch
    backend does (decodes, a chunk over a cached prefix, short verify chunks)."""
    seqs = [(69, 1), (32, 1), (0, 1), (37, 20), (16, 11), (30, 3)]
    _compare_backends(seqs, None, dtype, share=(3, 4), kv_dtype=kv_dtype)


def _compare_backends(
    seqs,
    window: int | None,
    dtype: torch.dtype,
    share: tuple[int, int] | None = None,
    kv_dtype: torch.dtype | None = None,
):
    block_size, qpk, head_dim = 8, 4, 64
    gen = torch.Generator().manual_seed(3)
    free = torch.randperm(64, generator=gen).tolist()
    block_ids = []
    for c, n in seqs:
        nb = -(-(c + n) // block_size)
        block_ids.append([free.pop() for _ in range(nb)])
    if share is not None:
        block_ids[share[1]][:2] = block_ids[share[0]][:2]
    kv = torch.randn((64, 2, 2, block_size, KV_HEADS, head_dim), generator=gen).to(dtype)
    if kv_dtype is None:
        triton_kv, torch_kv = kv.clone().to(DEVICE), kv.clone()
    else:  # the context quantized as written, one block at a time; NaN nowhere (scales are real)
        torch_kv = QuantizedKVCache.allocate(64, tuple(kv.shape[1:]), kv_dtype, "cpu")
        for layer in range(2):
            for side in range(2):
                x = kv[:, layer, side].flatten(0, 1).float()
                blocks = torch.arange(64).repeat_interleave(block_size)
                store(torch_kv, layer, side, x, blocks, torch.arange(block_size).repeat(64))
        triton_kv = QuantizedKVCache.from_raw(torch_kv.raw.clone().to(DEVICE), tuple(kv.shape[1:]), kv_dtype)

    triton_backend = TritonAttentionBackend(decode_partition_size=32)  # the 70-token decode splits in 3
    torch_backend = TorchAttentionBackend()
    triton_meta = _runner_meta(seqs, block_ids, block_size, DEVICE)
    triton_backend.prepare(triton_meta)
    torch_meta = _runner_meta(seqs, block_ids, block_size, "cpu")  # the oracle runs on CPU
    torch_backend.prepare(torch_meta)

    num_tokens = sum(n for _, n in seqs)
    for layer in range(2):  # the plan from prepare() serves every layer of the step
        # Strided views of one fused projection, as the model hands them over.
        qkv = torch.randn((num_tokens, KV_HEADS * (qpk + 2), head_dim), generator=gen).to(dtype)
        split = [KV_HEADS * qpk, KV_HEADS, KV_HEADS]
        q, k, v = qkv.split(split, dim=1)
        scale = head_dim**-0.5
        dev = qkv.to(DEVICE).split(split, dim=1)
        out = triton_backend.forward(layer, *dev, triton_kv, triton_meta, scale, window)
        ref = torch_backend.forward(layer, q, k, v, torch_kv, torch_meta, scale, window)
        assert out.shape == ref.shape == q.shape
        _close(out, ref)
    if kv_dtype is None:
        assert torch.equal(triton_kv.cpu(), torch_kv)
    else:
        assert torch.equal(triton_kv.raw.cpu(), torch_kv.raw)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="needs a CUDA GPU (compiled kernels)")
def test_compiled_kernels_at_serving_shapes() -> None:
    """Real sizes (too slow for the interpreter): 8-way GQA, head dim 128, contexts up to 6k tokens."""
    block_size, head_dim, qpk, dtype = 16, 128, 8, torch.bfloat16
    gen = torch.Generator().manual_seed(4)
    lens = torch.randint(1, 6000, (48,), generator=gen).tolist()
    kv, tables = _paged_cache(lens, block_size, head_dim, dtype)
    q = _queries(len(lens), qpk, head_dim, dtype)
    args = (q, kv[:, 1, 0], kv[:, 1, 1], tables, torch.tensor(lens, device=DEVICE))
    for window in (None, 4096):
        out = tk.paged_decode_attention(*args, max(lens), head_dim**-0.5, window)  # split in 512s
        _close(out, tk.paged_decode_attention_ref(*args, head_dim**-0.5, window))
    chunks = [min(n, 512) for n in lens[:8]]  # the last up-to-512 tokens of each context as a chunk
    starts = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], device=DEVICE)
    q = _queries(sum(chunks), qpk, head_dim, dtype)
    args = (q, kv[:, 1, 0], kv[:, 1, 1], tables[:8], starts, torch.tensor(lens[:8], device=DEVICE))
    out = tp.paged_prefill_attention(*args, max(chunks), head_dim**-0.5, 4096)
    _close(out, tp.paged_prefill_attention_ref(*args, head_dim**-0.5, 4096))
