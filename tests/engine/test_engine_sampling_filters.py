"""top-k, top-p and min-p through the whole engine (scheduler -> model runner -> sampler).

The sampler alone is tested on tensors (test_sampler.py); here the model runner has to build the
``SamplingBatch`` and switch each filter on. At temperature 2.0 a filter that keeps only the argmax
must give exactly the greedy tokens, while the same seeded request without the filter does not: so a
filter the runner forgets to enable fails these tests.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11, 12, 13, 14, 15], [20] * 11]
MAX_TOKENS = 12
# Each keeps only the most likely token (no ties in a random model's logits).
ARGMAX_ONLY = {"top_p": {"top_p": 1e-6}, "min_p": {"min_p": 0.999}, "top_k": {"top_k": 1}}


def _hot(seed: int, **filters) -> SamplingParams:
    return SamplingParams(temperature=2.0, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True, **filters)


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), block_size=8, num_blocks=64)


@pytest.fixture(scope="module")
def greedy(llm) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _generate(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS[: len(params)], params, use_tqdm=False)]


def test_unfiltered_hot_sampling_differs_from_greedy(llm, greedy):
    """The control: without a filter, the seeded requests below would not be greedy."""
    unfiltered = _generate(llm, [_hot(seed=i) for i in range(len(PROMPTS))])
    assert all(u != g for u, g in zip(unfiltered, greedy)), (unfiltered, greedy)


@pytest.mark.parametrize("name", list(ARGMAX_ONLY))
def test_argmax_only_filter_gives_greedy_tokens(llm, greedy, name):
    filtered = _generate(llm, [_hot(seed=i, **ARGMAX_ONLY[name]) for i in range(len(PROMPTS))])
    assert filtered == greedy


@pytest.mark.parametrize("name", list(ARGMAX_ONLY))
def test_filtered_request_next_to_an_unfiltered_one(llm, greedy, name):
    """One generate call, one batch: the filter applies to its own row only."""
    alone = llm.generate([PROMPTS[1]], _hot(seed=1), use_tqdm=False)[0].token_ids
    filtered, unfiltered = _generate(llm, [_hot(seed=0, **ARGMAX_ONLY[name]), _hot(seed=1)])
    assert filtered == greedy[0]
    assert unfiltered == alone != greedy[1]


def test_every_filter_in_one_batch(llm, greedy):
    """top-p, min-p and top-k rows, each next to the others, plus an unfiltered row."""
    prompts = [PROMPTS[0]] * 3 + [PROMPTS[1]]
    params = [_hot(seed=i, **f) for i, f in enumerate(ARGMAX_ONLY.values())] + [_hot(seed=7)]
    outs = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs[:3] == [greedy[0]] * 3
    assert outs[3] != greedy[1]
    assert llm.stats().num_free_blocks == 64
