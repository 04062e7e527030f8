"""Rejection sampling keeps the target's distribution: checked with chi-square tests over many seeds,
on the sampler alone and through the engine on a model with a small vocabulary."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine import LLM, SamplingParams
from engine.rejection_sampler import accepted_prefix, rejection_sample
from engine.sampler import SamplingBatch, filtered_probs

# Chi-square critical values at p = 0.001 by degrees of freedom: a correct sampler fails 1 in 1000.
_CHI2_999 = dict(
    enumerate(
        [
            10.83,
            13.82,
            16.27,
            18.47,
            20.52,
            22.46,
            24.32,
            26.12,
            27.88,
            29.59,
            31.26,
            32.91,
            34.53,
            36.12,
            37.70,
        ],
        start=1,
    )
)


def _batch(n: int, temperature: float = 1.0, top_k: int = 0, seed0: int = 0, position: int = 5):
    return SamplingBatch(
        temperature=torch.full((n,), temperature),
        top_k=torch.full((n,), top_k, dtype=torch.int64),
        top_p=torch.ones(n),
        min_p=torch.zeros(n),
        seeds=torch.arange(seed0, seed0 + n, dtype=torch.int64) * 7919 + 13,
        positions=torch.full((n,), position, dtype=torch.int64),
        all_greedy=temperature == 0,
        any_top_k=top_k > 0,
        any_top_p=False,
        any_min_p=False,
        max_logprobs=None,
    )


def _chi2(observed: Counter, probs: list[float], n: int) -> tuple[float, int]:
    stat, cells = 0.0, 0
    for t, p in enumerate(probs):
        if p * n >= 5:
            stat += (observed.get(t, 0) - p * n) ** 2 / (p * n)
            cells += 1
        else:
            assert observed.get(t, 0) <= max(5, 3 * p * n), f"token {t} drawn far too often"
    return stat, cells - 1


@pytest.mark.parametrize(
    ("temperature", "top_k", "draft"), [(1.0, 0, 0), (1.0, 0, 3), (0.7, 4, 1), (1.3, 0, 5), (1.0, 3, 5)]
)
def test_emitted_token_follows_the_target_distribution(temperature, top_k, draft):
    """Whatever the (one-hot) draft proposes, likely or not, or outside top-k, the emitted token is
    distributed as the target's filtered distribution."""
    n = 20000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, 1.5]]).repeat(n, 1)
    batch = _batch(n, temperature, top_k)
    v = rejection_sample(logits, batch, torch.full((n,), draft, dtype=torch.int64))
    probs = filtered_probs(logits[:1], _batch(1, temperature, top_k))[0]
    probs = (probs / probs.sum()).tolist()
    stat, df = _chi2(Counter(v.emitted.tolist()), probs, n)
    assert stat < _CHI2_999[df], (stat, df)
    assert abs(v.accepted.float().mean().item() - probs[draft]) < 0.02  # accepted with probability p(d)


def test_greedy_rows_accept_exactly_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    v = rejection_sample(logits, _batch(3, temperature=0.0), torch.tensor([1, 2, -1]))
    assert v.accepted.tolist() == [True, False, False]
    assert v.emitted.tolist() == [1, 1, 0]


def test_accepted_prefix_stops_at_the_first_rejection():
    emitted = [10, 11, 12, 13, 20, 21, 22]
    assert accepted_prefix(emitted, [True, True, False, False, True, True, False], 0, 3) == [10, 11, 12]
    assert accepted_prefix(emitted, [True, True, True, False, False, True, False], 0, 3) == [10, 11, 12, 13]
    assert accepted_prefix(emitted, [False] * 4 + [True, True, False], 4, 2) == [20, 21, 22]


def test_engine_samples_keep_the_distribution_of_non_speculative_decoding(tiny_model_factory):
    """Two-sample chi-square on the generated tokens after the first over many seeds: the same
    distribution with and without speculation. The draft is the target's greedy choice, which a
    sampled target accepts only sometimes."""
    target = tiny_model_factory("llama", vocab_size=16, num_hidden_layers=2)
    prompt = [5, 9, 4, 12, 7]
    n = 1500
    params = [SamplingParams(temperature=0.6, max_tokens=4, ignore_eos=True, seed=s) for s in range(n)]
    plain = LLM(str(target), num_blocks=4096, block_size=4, max_num_seqs=512)
    spec = LLM(
        str(target),
        num_blocks=4096,
        block_size=4,
        max_num_seqs=512,
        speculative_config={"method": "draft_model", "model": str(target), "num_speculative_tokens": 2},
    )
    a = [o.outputs[0].token_ids for o in plain.generate([prompt] * n, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in spec.generate([prompt] * n, params, use_tqdm=False)]
    stats = spec.stats()
    assert 0.1 < stats.spec_acceptance_rate < 0.9, stats  # both outcomes occur
    for llm in (plain, spec):
        assert llm.stats().num_free_blocks == llm.stats().num_blocks
    for pos in (1, 2, 3):
        ca, cb = Counter(t[pos] for t in a), Counter(t[pos] for t in b)
        stat, df = 0.0, -1
        for tok in set(ca) | set(cb):
            if ca[tok] + cb[tok] >= 10:
                stat += (ca[tok] - cb[tok]) ** 2 / (ca[tok] + cb[tok])
                df += 1
        assert stat < _CHI2_999[df], (pos, stat, df)
