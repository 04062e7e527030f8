"""Sampler on plain tensors (no model): greedy, seeded sampling, the filters, and logprobs."""

from __future__ import annotations

import torch

from engine.sampler import Sampler, SamplerOutput, SamplingBatch, row_argmax, sample_seed, uniform_noise

sampler = Sampler()


def make_batch(
    n: int,
    *,
    temperature: float | list[float] = 1.0,
    top_k: int | list[int] = 0,
    top_p: float | list[float] = 1.0,
    min_p: float | list[float] = 0.0,
    seeds: list[int] | None = None,
    positions: list[int] | None = None,
    max_logprobs: int | None = None,
) -> SamplingBatch:
    """Per-row parameters (a scalar applies to every row), flags computed as the model runner does."""

    def col(v: float | list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(v if isinstance(v, list) else [v] * n, dtype=dtype)

    temp = col(temperature, torch.float32)
    k = col(top_k, torch.int64)
    p = col(top_p, torch.float32)
    m = col(min_p, torch.float32)
    return SamplingBatch(
        temperature=temp,
        top_k=k,
        top_p=p,
        min_p=m,
        seeds=torch.tensor(seeds if seeds is not None else [0] * n, dtype=torch.int64),
        positions=torch.tensor(positions if positions is not None else list(range(n)), dtype=torch.int64),
        all_greedy=bool(((temp == 0) | (k == 1)).all()),
        any_top_k=bool((k > 0).any()),
        any_top_p=bool((p < 1).any()),
        any_min_p=bool((m > 0).any()),
        max_logprobs=max_logprobs,
    )


def sample(logits: torch.Tensor, **kwargs) -> SamplerOutput:
    return sampler(logits, make_batch(logits.shape[0], **kwargs))


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


def test_row_argmax_is_torchs_argmax_on_ties_infinities_and_nans() -> None:
    """The CPU's numpy argmax picks what torch's would: the first of tied maxima, a NaN as the
    maximum, a row of -inf at 0; strided views too, and other dtypes through torch itself."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (96, 33), generator=g).float()  # many ties; large enough for numpy
    x[3] = float("-inf")
    x[5, 7] = float("inf")
    x[6, 2] = x[6, 9] = float("nan")
    x[7, 4] = float("nan")
    x[7, 5] = float("inf")
    for t in (x, x[:, 1:30], x.t().contiguous().t(), x.double(), x.to(torch.bfloat16)):
        got = row_argmax(t)
        assert got.dtype == torch.int64 and torch.equal(got, t.argmax(dim=-1)), t.dtype


def test_temperature_zero_is_argmax() -> None:
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(logits, temperature=0.0).token_ids, logits.argmax(-1))


def test_greedy_rows_stay_argmax_in_a_mixed_batch() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
    temps = [0.0, 1.0] * 4
    tokens = sample(logits, temperature=temps, seeds=list(range(8))).token_ids
    assert torch.equal(tokens[0::2], logits[0::2].argmax(-1))


def test_seeded_sample_depends_only_on_seed_and_position() -> None:
    logits = torch.zeros(1, 1000)  # uniform: the token is decided by the noise alone
    rows = [(11, 5), (22, 9), (33, 0), (44, 123)]
    alone = [sample(logits, seeds=[seed], positions=[pos]).token_ids.item() for seed, pos in rows]
    batched = sample(logits.expand(4, -1), seeds=[s for s, _ in rows], positions=[p for _, p in rows])
    assert batched.token_ids.tolist() == alone
    # Reordered, and mixed with other rows and other sampling settings.
    order = [3, 1, 0, 2]
    mixed_seeds = [7, *[rows[i][0] for i in order], 8]
    mixed_pos = [1, *[rows[i][1] for i in order], 2]
    mixed = sample(
        logits.expand(6, -1),
        seeds=mixed_seeds,
        positions=mixed_pos,
        temperature=[0.0, 1.0, 1.0, 1.0, 1.0, 0.5],
        top_p=[1.0, 1.0, 1.0, 1.0, 1.0, 0.9],
    )
    assert mixed.token_ids[1:5].tolist() == [alone[i] for i in order]


def test_same_seed_and_position_repeat_the_same_token() -> None:
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(2))
    kwargs = {"seeds": [123] * 64, "positions": list(range(64)), "temperature": 0.9}
    assert torch.equal(sample(logits, **kwargs).token_ids, sample(logits, **kwargs).token_ids)


def test_different_seeds_give_different_samples() -> None:
    logits = torch.zeros(500, 50)
    positions = list(range(500))
    a = sample(logits, seeds=[1] * 500, positions=positions).token_ids
    b = sample(logits, seeds=[2] * 500, positions=positions).token_ids
    high_bits = sample(logits, seeds=[1 + (1 << 40)] * 500, positions=positions).token_ids
    # Independent uniform draws over 50 tokens agree about 2% of the time.
    assert (a == b).float().mean() < 0.1
    assert (a == high_bits).float().mean() < 0.1
    # And one seed does not repeat a token along the positions.
    assert len(set(a.tolist())) > 40


def test_empirical_distribution_matches_softmax_over_temperature() -> None:
    n, temperature = 20_000, 0.7
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -2.0]])
    expected = torch.softmax(logits[0] / temperature, -1).double()
    for seed in (0, 987654321):
        tokens = sample(
            logits.expand(n, -1), temperature=temperature, seeds=[seed] * n, positions=list(range(n))
        ).token_ids
        assert (frequencies(tokens, 5) - expected).abs().max() < 0.02


def test_empirical_distribution_across_seeds_at_one_position() -> None:
    n = 20_000
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0, -1.0]])
    tokens = sample(logits.expand(n, -1), seeds=list(range(n)), positions=[17] * n).token_ids
    assert (frequencies(tokens, 5) - torch.softmax(logits[0], -1).double()).abs().max() < 0.02


def test_top_k_one_is_greedy_at_any_temperature() -> None:
    logits = torch.randn(256, 40, generator=torch.Generator().manual_seed(3))
    batch = make_batch(256, temperature=1.5, top_k=1, seeds=list(range(256)))
    batch.all_greedy = False  # force the random path to prove the filter itself is greedy
    assert torch.equal(sampler(logits, batch).token_ids, logits.argmax(-1))


def test_top_k_keeps_only_the_k_most_likely_tokens() -> None:
    n = 4000
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.5, 0.0, -1.0]])
    tokens = sample(logits.expand(n, -1), top_k=3, seeds=[5] * n).token_ids
    assert set(tokens.tolist()) == {0, 1, 2}
    expected = torch.softmax(logits[0, :3], -1).double()
    assert (frequencies(tokens, 6)[:3] - expected).abs().max() < 0.03


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    logits = torch.randn(256, 40, generator=torch.Generator().manual_seed(4))
    tokens = sample(logits, top_p=1e-6, seeds=list(range(256))).token_ids
    assert torch.equal(tokens, logits.argmax(-1))


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    n = 4000
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    # 0.5 < 0.6, so the second token is needed; 0.5 + 0.3 >= 0.6, so the third is not.
    tokens = sample(logits.expand(n, -1), top_p=0.6, seeds=[9] * n).token_ids
    assert set(tokens.tolist()) == {0, 1}
    assert abs(frequencies(tokens, 4)[0].item() - 0.5 / 0.8) < 0.03


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability() -> None:
    n = 4000
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    tokens = sample(logits.expand(n, -1), min_p=0.5, seeds=[3] * n).token_ids  # keeps p >= 0.25
    assert set(tokens.tolist()) == {0, 1}
    assert abs(frequencies(tokens, 4)[0].item() - 0.5 / 0.8) < 0.03


def test_logprobs_have_the_requested_shape_and_match_log_softmax() -> None:
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(5))
    out = sample(logits, temperature=[0.0, 0.7] * 3, seeds=list(range(6)), max_logprobs=4)
    expected = torch.log_softmax(logits, -1)
    assert out.sampled_logprobs.shape == (6,)
    assert out.top_ids.shape == out.top_logprobs.shape == (6, 4)
    torch.testing.assert_close(out.sampled_logprobs, expected.gather(1, out.token_ids[:, None]).squeeze(1))
    torch.testing.assert_close(out.top_logprobs, expected.topk(4, -1).values)
    assert torch.equal(out.top_ids, expected.topk(4, -1).indices)


def test_logprobs_zero_returns_only_the_sampled_token_and_none_returns_nothing() -> None:
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(6))
    only_sampled = sample(logits, temperature=0.0, max_logprobs=0)
    assert only_sampled.sampled_logprobs.shape == (3,)
    assert only_sampled.top_ids is None and only_sampled.top_logprobs is None
    nothing = sample(logits, temperature=0.0)
    assert nothing.sampled_logprobs is None and nothing.top_ids is None


def test_uniform_noise_is_strictly_inside_zero_one() -> None:
    u = uniform_noise(torch.arange(64, dtype=torch.int64), torch.arange(64, dtype=torch.int64), 4096)
    assert u.shape == (64, 4096) and u.dtype == torch.float32
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert abs(u.double().mean().item() - 0.5) < 0.01


def test_sample_seed_keeps_sample_zero_and_separates_the_others() -> None:
    for seed in (0, 42, 2**40 + 7, 2**63 - 1):
        assert sample_seed(seed, 0) == seed
        seeds = [sample_seed(seed, i) for i in range(64)]
        assert len(set(seeds)) == 64
        assert all(0 <= s < 2**63 for s in seeds)
        assert seeds == [sample_seed(seed, i) for i in range(64)]  # deterministic
