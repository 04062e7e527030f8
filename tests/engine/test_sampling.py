"""Random sampling: reproducible for a seed, different across seeds, n > 1 sharing prompt blocks."""

from __future__ import annotations

from engine import LLM, EngineConfig, EngineCore, SamplingParams


def _sample(llm: LLM, prompts, **kw):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, ignore_eos=True, **kw)
    return llm.generate(prompts, params, use_tqdm=False)


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=8, num_blocks=64)
    alone = _sample(llm, [[7, 8, 9]], seed=42)[0].token_ids
    batched = _sample(llm, [[1, 2, 3, 4, 5], [7, 8, 9], [20] * 9], seed=42)[1].token_ids
    other_engine = _sample(LLM(str(tiny_llama), block_size=4, num_blocks=64, seed=123), [[7, 8, 9]], seed=42)[
        0
    ].token_ids
    assert alone == batched == other_engine
    assert _sample(llm, [[7, 8, 9]], seed=43)[0].token_ids != alone


def test_parallel_samples_reproducible_and_distinct(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=8, num_blocks=64)
    a = _sample(llm, [[7, 8, 9]], seed=5, n=4)[0]
    b = _sample(llm, [[7, 8, 9]], seed=5, n=4)[0]
    c = _sample(llm, [[7, 8, 9]], seed=6, n=4)[0]
    samples = [o.token_ids for o in a.outputs]
    assert samples == [o.token_ids for o in b.outputs]
    assert samples != [o.token_ids for o in c.outputs]
    assert len({tuple(s) for s in samples}) == 4
    assert samples[0] == _sample(llm, [[7, 8, 9]], seed=5)[0].token_ids  # sample 0 is the n=1 sample
    assert all(len(s) == 12 for s in samples)
    assert llm.stats().num_free_blocks == 64


def _used_blocks_after_fork(tiny_llama, prompt_len: int, n: int) -> int:
    core = EngineCore(
        EngineConfig(model=str(tiny_llama), block_size=16, num_blocks=64, enable_prefix_caching=False)
    )
    core.add_request(
        "r",
        list(range(3, 3 + prompt_len)),
        SamplingParams(n=n, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True),
    )
    core.step()  # prompt: forks n samples
    core.step()  # every sample writes its second token
    used = 64 - core.stats().num_free_blocks
    core.abort_request("r")
    assert core.stats().num_free_blocks == 64
    return used


def test_parallel_samples_count_shared_prompt_blocks_once(tiny_llama):
    # 64 tokens = 4 full blocks, shared; each of 4 samples writes its next token into a block of its own.
    assert _used_blocks_after_fork(tiny_llama, 64, 4) == 4 + 4
    # 60 tokens: the partial 4th block is shared copy-on-write; 3 samples copy it, the last one keeps it.
    assert _used_blocks_after_fork(tiny_llama, 60, 4) == 4 + 3


def test_top_k_one_equals_greedy(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=8, num_blocks=64)
    greedy = llm.generate(
        [[3, 4, 5]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    top1 = llm.generate(
        [[3, 4, 5]],
        SamplingParams(temperature=2.0, top_k=1, max_tokens=8, ignore_eos=True, seed=9),
        use_tqdm=False,
    )
    assert greedy[0].token_ids == top1[0].token_ids
