"""Greedy output is token-identical to HF transformers' ``generate`` (float32, tiny random models).

Every architecture in one batch of mixed-length prompts, then the engine's hard paths on Llama:
chunked prefill, every scheduling policy, prefix-cache hits, preemption by recompute and by swap, and
a sharded checkpoint.
"""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.config import SCHEDULING_POLICIES

MAX_NEW = 12


def _prompts(seed: int, lengths: list[int], vocab: int = 1024) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _check(llm: LLM, model_dir, prompts, hf_greedy, max_new: int = MAX_NEW):
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model_dir, prompt, max_new), (
            f"mismatch for prompt of {len(prompt)} tokens"
        )
        assert out.finish_reason == "length"
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_blocks
    return outs


ARCHS = [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("mistral", {"sliding_window": 16}),
    ("qwen2", {}),
    ("qwen3", {"head_dim": 32}),
]


@pytest.mark.parametrize(
    ("arch", "overrides"), ARCHS, ids=["llama", "llama-tied", "mistral-swa", "qwen2-bias", "qwen3-qknorm"]
)
def test_mixed_batch_matches_hf(tiny_model_factory, hf_greedy, arch, overrides):
    model_dir = tiny_model_factory(arch, **overrides)
    llm = LLM(str(model_dir), block_size=8, num_blocks=128)
    _check(llm, model_dir, _prompts(1, [1, 5, 8, 13, 29, 40]), hf_greedy)


def test_chunked_prefill_matches_hf(tiny_llama, hf_greedy):
    llm = LLM(str(tiny_llama), block_size=8, num_blocks=128, max_num_batched_tokens=16)
    _check(llm, tiny_llama, _prompts(2, [3, 17, 33, 70]), hf_greedy)


def test_chunked_prefill_qwen3_matches_hf(tiny_model_factory, hf_greedy):
    model_dir = tiny_model_factory("qwen3", head_dim=32)
    llm = LLM(str(model_dir), block_size=4, num_blocks=256, max_num_batched_tokens=16)
    _check(llm, model_dir, _prompts(3, [9, 31, 50]), hf_greedy)


@pytest.mark.parametrize("policy", SCHEDULING_POLICIES)
def test_every_scheduling_policy_matches_hf(tiny_llama, hf_greedy, policy):
    # Three sequences at a time: later prompts prefill next to running decodes, in chunks (fair: the
    # ITL target cannot be met, so prompts run in the guaranteed minimum chunks).
    llm = LLM(
        str(tiny_llama),
        block_size=8,
        num_blocks=128,
        max_num_seqs=3,
        max_num_batched_tokens=48,
        scheduling_policy=policy,
        itl_target_ms=0.001,
    )
    _check(llm, tiny_llama, _prompts(10, [3, 17, 33, 70, 5, 41]), hf_greedy)
    batching = llm.core.scheduler.batching
    assert (batching is not None and batching.cost_model() is not None) == (policy == "fair")


def test_prefix_cache_hits_match_hf(tiny_llama, hf_greedy):
    llm = LLM(str(tiny_llama), block_size=8, num_blocks=128)
    shared = _prompts(4, [48])[0]
    prompts = [shared + tail for tail in _prompts(5, [3, 9, 17])]
    _check(llm, tiny_llama, prompts, hf_greedy)
    assert llm.stats().prefix_cache_hits > 0  # later prompts reused the shared prefix's blocks
    hits_before = llm.stats().prefix_cache_hits
    _check(llm, tiny_llama, prompts, hf_greedy)  # the same prompts again: cached blocks, same tokens
    assert llm.stats().prefix_cache_hits - hits_before >= 3 * 40


def test_prompt_fully_cached_still_recomputes_last_token(tiny_llama, hf_greedy):
    llm = LLM(str(tiny_llama), block_size=8, num_blocks=64)
    prompt = _prompts(6, [32])[0]  # exactly 4 full blocks
    _check(llm, tiny_llama, [prompt], hf_greedy)
    _check(llm, tiny_llama, [prompt], hf_greedy)
    assert llm.stats().prefix_cache_hits == 24  # 3 of 4 blocks: the last token's logits are recomputed


@pytest.mark.parametrize("swap_space", [0.0, 0.01], ids=["recompute", "swap"])
def test_preemption_matches_hf(tiny_llama, hf_greedy, swap_space):
    # 8 prompts of ~20 tokens + 24 new each need ~48 blocks of 4; 24 blocks force preemption.
    llm = LLM(
        str(tiny_llama), block_size=4, num_blocks=24, swap_space=swap_space, enable_prefix_caching=False
    )
    _check(llm, tiny_llama, _prompts(7, [20, 18, 22, 15, 19, 21, 17, 16]), hf_greedy, max_new=24)
    stats = llm.stats()
    assert stats.num_preemptions > 0
    assert (stats.num_swap_outs > 0) == (swap_space > 0)  # swap preempts by swapping, not recompute


def test_sharded_checkpoint_matches_hf(tiny_model_factory, hf_greedy):
    model_dir = tiny_model_factory("llama", max_shard_size="100KB")
    assert (model_dir / "model.safetensors.index.json").exists()
    llm = LLM(str(model_dir), block_size=8, num_blocks=64)
    _check(llm, model_dir, _prompts(8, [6, 25]), hf_greedy)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_and_mostly_agrees(tiny_llama, hf_greedy, dtype):
    llm = LLM(str(tiny_llama), block_size=8, num_blocks=64, dtype=dtype)
    prompts = _prompts(9, [10, 30])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == 8
        # Rounding may flip a later argmax, but the first token of a non-flat model agrees.
        assert out.token_ids[0] == hf_greedy(tiny_llama, prompt, 1)[0]


def test_linear_rope_scaling_serves_its_stretched_context_as_hf(tiny_model_factory, hf_greedy):
    """A linear rope factor stretches the trained positions (vicuna-16k: 4096 x 4): the engine's
    context is max_position_embeddings x factor, as vLLM's, and output past the trained length
    matches HF's (it was capped at the trained length: such a prompt was refused)."""
    model = tiny_model_factory(
        "llama", max_position_embeddings=32, rope_scaling={"rope_type": "linear", "factor": 4.0}
    )
    llm = LLM(str(model), block_size=8, num_blocks=64)
    assert llm.core.max_model_len == 128
    _check(llm, model, _prompts(3, [70, 9]), hf_greedy)
