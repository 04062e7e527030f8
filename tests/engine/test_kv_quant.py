"""Quantized KV cache (int8, fp8): a scale per token, layer, K/V and head, written with the token, so
what a token stores does not depend on the tokens written with it; blocks carry their scales through
swaps, copy-on-write and transfers; the pool holds more tokens in the same bytes; outputs stay close
to full precision and identical across the engine's paths (speculation included)."""

from __future__ import annotations

import pytest
import torch
from test_disaggregation import BLOCK, _disaggregated

from engine import LLM, EngineConfig, EngineCore, SamplingParams
from engine.kv_cache import KVLayout
from engine.kv_quant import QuantizedKVCache, gather, store
from kv_transfer.compat import KVCompat, KVIncompatibleError, check_compatible

DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# Worst relative error of one dequantized element against its token's largest magnitude (per head):
# half a step of int8's 127 levels; e4m3 keeps 3 mantissa bits.
TOLERANCE = {"int8": 0.51 / 127, "fp8": 0.07}


def _cache(dtype: str, num_blocks: int = 6, block_size: int = 4, kvh: int = 2, hd: int = 8):
    return QuantizedKVCache.allocate(num_blocks, (2, 2, block_size, kvh, hd), DTYPES[dtype], "cpu")


def _store(cache, layer, kv, x, blocks, offsets) -> None:
    store(cache, layer, kv, x, torch.tensor(blocks), torch.tensor(offsets))


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_token_is_quantized_with_its_own_scale(dtype):
    cache = _cache(dtype)
    gen = torch.Generator().manual_seed(0)
    want = torch.cat([torch.randn((1, 2, 8), generator=gen) * (1 + 30 * i) for i in range(4)])  # each larger
    _store(cache, 1, 0, want, [3] * 4, range(4))
    got = gather(cache, 1, 0, torch.tensor([3]), torch.float32)[0]  # [bs, kvh, hd]
    amax = want.abs().amax(dim=2)  # per token and head
    assert torch.allclose(cache.scales[3, 1, 0], amax / (127 if dtype == "int8" else 448))
    err = ((got - want).abs().amax(dim=2) / amax).max().item()
    assert err < TOLERANCE[dtype], err  # the small first token keeps its precision beside the large last
    assert cache.scales[3, 1, 1].abs().sum() == 0 and cache.scales[3, 0, 0].abs().sum() == 0  # untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_token_stores_the_same_bytes_however_its_writes_are_grouped(dtype):
    """A block written one token a step, all at once, or after other values were written into its
    slots and then rewritten (a verify step's rejected drafts) ends up byte for byte the same: what
    speculative decoding, chunked prefill and prefix hits need to keep greedy output unchanged."""
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randn((4, 2, 8), generator=gen) * torch.tensor([1.0, 50.0, 0.1, 7.0])[:, None, None]
    one_by_one, whole, redrafted = _cache(dtype), _cache(dtype), _cache(dtype)
    for i in range(4):
        _store(one_by_one, 0, 1, tokens[i : i + 1], [2], [i])
    _store(whole, 0, 1, tokens, [2] * 4, range(4))
    _store(redrafted, 0, 1, tokens[:1], [2], [0])
    _store(redrafted, 0, 1, torch.full((3, 2, 8), 1000.0), [2] * 3, [1, 2, 3])  # drafts, rejected
    _store(redrafted, 0, 1, tokens[1:], [2] * 3, [1, 2, 3])
    assert torch.equal(one_by_one.raw, whole.raw) and torch.equal(whole.raw, redrafted.raw)


def test_the_same_byte_budget_holds_over_3x_the_tokens_with_int8(tiny_llama):
    """A token and head: 16 bytes of data and 4 of scale against 64 of float32 (the tiny model's
    head_dim is 16; 3.2x, and at head_dim 128 against bfloat16, 1.94x)."""
    sizes = {}
    for kv in ("auto", "int8", "fp8"):
        core = EngineCore(
            EngineConfig(model=str(tiny_llama), kv_cache_memory_bytes=8 << 20, kv_cache_dtype=kv)
        )
        sizes[kv] = core.kv.num_blocks
    assert sizes["int8"] == sizes["fp8"] >= 3.1 * sizes["auto"]


def test_a_block_row_is_its_data_and_scales(tiny_llama):
    """One contiguous region per block: copying rows of ``raw`` moves the scales with the data."""
    layout = KVLayout(2, 4, 2, 8, torch.float32, torch.int8)
    cache = layout.allocate(3, "cpu")
    assert (
        cache.raw.shape == (3, layout.block_bytes)
        and layout.block_bytes == 2 * 2 * 4 * 2 * 8 + 2 * 2 * 4 * 2 * 4
    )
    _store(cache, 0, 0, torch.randn(4, 2, 8), [0] * 4, range(4))
    cache.raw[1].copy_(cache.raw[0])
    assert torch.equal(cache.scales[1], cache.scales[0]) and torch.equal(cache.data[1], cache.data[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_outputs_stay_close_to_full_precision(tiny_llama, dtype):
    prompts = [list(range(20, 60)), [5, 6, 7, 8, 9] * 6]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    full = LLM(str(tiny_llama), block_size=BLOCK, num_blocks=64).generate(prompts, params, use_tqdm=False)
    quant = LLM(str(tiny_llama), block_size=BLOCK, num_blocks=64, kv_cache_dtype=dtype)
    outs = quant.generate(prompts, params, use_tqdm=False)
    worst = 0.0
    for f, q in zip(full, outs):
        if dtype == "int8":  # e4m3's coarser steps may flip a near-tie of this random model
            assert q.outputs[0].token_ids == f.outputs[0].token_ids
        for a, b in zip(f.prompt_logprobs[1:], q.prompt_logprobs[1:]):
            (ta, la), (tb, lb) = next(iter(a.items())), next(iter(b.items()))
            assert ta == tb
            worst = max(worst, abs(la - lb))
    assert worst < {"int8": 0.05, "fp8": 0.25}[dtype], worst
    stats = quant.stats()
    assert stats.num_free_blocks == stats.num_blocks


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_copy_on_write_and_prefix_hits_carry_the_scales(tiny_llama, dtype):
    """Preemption by swap (rows to the CPU pool and back), n = 2 (copy-on-write of the shared last
    block) and prefix-cache hits give the same tokens as the quantized engine without them."""
    shared = list(range(30, 54))
    prompts = [[*shared, 7, 8, 9], [*shared, 11], list(range(100, 140)), [3, 4, 5] * 9]
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=10, ignore_eos=True, n=2)
    roomy = LLM(
        str(tiny_llama), block_size=BLOCK, num_blocks=128, kv_cache_dtype=dtype, enable_prefix_caching=False
    )
    want = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = LLM(str(tiny_llama), block_size=BLOCK, num_blocks=20, kv_cache_dtype=dtype, swap_space=0.01)
    got = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params, use_tqdm=False)]
    stats = tight.stats()
    assert stats.num_swap_outs > 0 and stats.prefix_cache_hits > 0
    assert got == want
    assert stats.num_free_blocks == stats.num_blocks


def test_disaggregated_int8_equals_the_int8_engine_alone(tiny_llama):
    """The held blocks' rows (K/V and scales) copied byte for byte, as NIXL moves them."""
    prompt = list(range(40, 40 + 3 * BLOCK + 5))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def engine():
        return EngineCore(
            EngineConfig(model=str(tiny_llama), block_size=BLOCK, num_blocks=64, kv_cache_dtype="int8")
        )

    p, d = engine(), engine()
    tokens, _ = _disaggregated(p, d, "r", prompt, params)
    alone = LLM(str(tiny_llama), block_size=BLOCK, num_blocks=64, kv_cache_dtype="int8")
    assert tokens == alone.generate([prompt], params, use_tqdm=False)[0].token_ids
    for e in (p, d, alone.core):
        assert e.stats().num_free_blocks == 64 and e.stats().num_held == 0


def test_different_kv_dtypes_are_incompatible_and_hash_apart(tiny_llama):
    cores = {
        kv: EngineCore(EngineConfig(model=str(tiny_llama), block_size=BLOCK, num_blocks=8, kv_cache_dtype=kv))
        for kv in ("auto", "int8")
    }
    full, int8 = (KVCompat.from_layout("m", cores[k].layout) for k in ("auto", "int8"))
    assert full.hash() != int8.hash()
    with pytest.raises(KVIncompatibleError, match="dtype int8 != float32"):
        check_compatible(int8, full, "p0")
    assert cores["auto"].prefix_salt != cores["int8"].prefix_salt  # no prefix hit across KV dtypes
