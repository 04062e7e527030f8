"""The engine's two disaggregated roles, in one process: a prefill engine holds a prompt's blocks,
their bytes are copied into a decode engine's blocks (what NIXL does between processes), and the
decode engine continues from token 2. Output must equal one engine alone and HF transformers."""

from __future__ import annotations

import pytest

from engine import LLM, EngineConfig, EngineCore, SamplingParams

BLOCK = 8


def _engine(model_dir, **kw) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model_dir), block_size=BLOCK, num_blocks=64, **kw))


def _prefill(p: EngineCore, rid: str, prompt: list[int], params: SamplingParams):
    p.add_request(rid, prompt, params, prefill_only=True)
    while True:
        for out in p.step():
            if out.request_id == rid:
                return out


def _disaggregated(
    p: EngineCore, d: EngineCore, rid: str, prompt: list[int], params: SamplingParams, fail=False
):
    first = _prefill(p, rid, prompt, params)
    assert first.held_block_ids is not None and len(first.held_block_ids) == -(-len(prompt) // BLOCK)
    plan = d.add_transferred_request(rid, prompt, first.new_token_ids[0], params, seed=first.seed)
    if fail:
        d.fail_transfer(rid)
    else:
        for i, local in enumerate(plan.local_block_ids):
            d.runner.kv_blocks[local].copy_(
                p.runner.kv_blocks[first.held_block_ids[plan.first_block_index + i]]
            )
        d.complete_transfer(rid)
    assert p.release_held(rid)
    tokens = list(first.new_token_ids)
    while d.has_unfinished():
        for out in d.step():
            tokens.extend(out.new_token_ids)
    return tokens, plan


@pytest.mark.parametrize("prompt_len", [3, BLOCK, 5 * BLOCK + 3], ids=["short", "one-block", "many-blocks"])
def test_disaggregated_greedy_equals_engine_and_hf(tiny_llama, hf_greedy, prompt_len):
    prompt = [(7 * i + 3) % 1000 + 3 for i in range(prompt_len)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    p, d = _engine(tiny_llama), _engine(tiny_llama)
    tokens, _ = _disaggregated(p, d, "r", prompt, params)
    alone = LLM(str(tiny_llama), block_size=BLOCK, num_blocks=64).generate([prompt], params, use_tqdm=False)[
        0
    ]
    assert tokens == alone.token_ids == hf_greedy(tiny_llama, prompt, 10)
    for e in (p, d):
        assert e.stats().num_free_blocks == 64 and e.stats().num_held == 0


def test_decode_side_prefix_hit_pulls_only_missing_blocks(tiny_llama, hf_greedy):
    prompt = list(range(10, 10 + 4 * BLOCK + 2))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    p, d = _engine(tiny_llama), _engine(tiny_llama)
    first, plan1 = _disaggregated(p, d, "a", prompt, params)
    second, plan2 = _disaggregated(p, d, "b", prompt, params)
    assert plan1.first_block_index == 0 and len(plan1.local_block_ids) == 5
    assert plan2.first_block_index == 4 and len(plan2.local_block_ids) == 1  # 4 full blocks were cached
    assert first == second == hf_greedy(tiny_llama, prompt, 6)
    assert d.stats().num_free_blocks == 64


def test_seeded_sampling_continues_the_prefill_side_stream(tiny_llama):
    prompt = list(range(20, 45))
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, ignore_eos=True, seed=7)
    tokens, _ = _disaggregated(_engine(tiny_llama), _engine(tiny_llama, seed=99), "r", prompt, params)
    alone = LLM(str(tiny_llama), block_size=BLOCK, num_blocks=64).generate([prompt], params, use_tqdm=False)[
        0
    ]
    assert tokens == alone.token_ids


def test_failed_transfer_recomputes_to_the_same_output(tiny_llama, hf_greedy):
    prompt = list(range(30, 30 + 2 * BLOCK + 5))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    p, d = _engine(tiny_llama), _engine(tiny_llama)
    tokens, _ = _disaggregated(p, d, "r", prompt, params, fail=True)
    assert tokens == hf_greedy(tiny_llama, prompt, 8)
    assert d.stats().num_free_blocks == 64 and p.stats().num_free_blocks == 64


def test_first_token_that_ends_the_request_needs_no_decode(tiny_llama):
    d = _engine(tiny_llama)
    assert d.add_transferred_request("r", [5, 6, 7], 9, SamplingParams(max_tokens=1), seed=0) is None
    assert d.stats().num_free_blocks == 64 and not d.has_unfinished()


def test_prefill_role_refuses_parallel_samples_and_reused_ids(tiny_llama):
    p = _engine(tiny_llama)
    with pytest.raises(ValueError, match="n = 1"):
        p.add_request("x", [1, 2, 3], SamplingParams(n=2), prefill_only=True)
    _prefill(p, "y", [1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="already in use"):
        p.add_request("y", [1, 2, 3], SamplingParams(max_tokens=4))
    assert p.release_held("y") and not p.release_held("y")
    assert p.stats().num_free_blocks == 64


def test_pending_prompt_tokens_count_only_the_uncached_part_of_waiting_prompts(tiny_llama):
    """The prefill load a worker reports is the work it will do: a waiting prompt whose prefix the
    cache holds counts only its tail (else the router would see a warm worker as the busiest)."""
    p = _engine(tiny_llama)
    prefix = list(range(20, 20 + 4 * BLOCK))
    params = SamplingParams(temperature=0, max_tokens=4)
    _prefill(p, "warm", [*prefix, 7, 8, 9], params)
    p.release_held("warm")
    p.add_request("hit", [*prefix, 5, 6, 7, 8, 9], params)
    p.add_request("cold", list(range(300, 300 + 2 * BLOCK)), params)
    assert p.pending_prompt_tokens() == 5 + 2 * BLOCK
