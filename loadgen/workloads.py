"""Synthetic offline-benchmark workloads (torch-free).

Two generators, both deterministic for a given seed (``random.Random(seed)``) and both producing
random token ids in ``[10, vocab_size)`` so that low special-token ids (BOS/EOS/PAD) never appear:

* :func:`skewed_workload` -- prompts uniform in ``prompt_len`` (default 32-256 tokens) and a
  heavy-tailed output-length mix: 70% uniform 8-64, 20% uniform 64-192, 10% uniform 192-384 tokens.
  The mix is what separates static batching (every request waits for the longest one in its batch)
  from continuous/iteration-level batching.
* :func:`random_workload` -- vLLM-``benchmark_throughput``-style "random" dataset: input and output
  lengths uniform in ``[len * (1 - r), len * (1 + r)]``.

Requests are meant to be run with EOS ignored, so ``max_tokens`` is exactly the number of tokens
each request generates.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["BenchRequest", "random_workload", "skewed_workload"]

_MIN_TOKEN_ID = 10

# (probability, (min_tokens, max_tokens)) -- bounds inclusive.
_SKEWED_OUTPUT_MIX: tuple[tuple[float, tuple[int, int]], ...] = (
    (0.70, (8, 64)),
    (0.20, (64, 192)),
    (0.10, (192, 384)),
)


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One offline request: a tokenized prompt and the exact number of tokens to generate."""

    prompt_token_ids: list[int]
    max_tokens: int


def _random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    if vocab_size <= _MIN_TOKEN_ID:
        raise ValueError(f"vocab_size must be > {_MIN_TOKEN_ID}, got {vocab_size}")
    return [rng.randrange(_MIN_TOKEN_ID, vocab_size) for _ in range(length)]


def _sample_skewed_output_len(rng: random.Random) -> int:
    u = rng.random()
    cumulative = 0.0
    for prob, (lo, hi) in _SKEWED_OUTPUT_MIX:
        cumulative += prob
        if u < cumulative:
            return rng.randint(lo, hi)
    lo, hi = _SKEWED_OUTPUT_MIX[-1][1]
    return rng.randint(lo, hi)


def skewed_workload(
    num_requests: int = 48,
    vocab_size: int = 8192,
    seed: int = 0,
    prompt_len: tuple[int, int] = (32, 256),
) -> list[BenchRequest]:
    """Prompts uniform in ``prompt_len`` (inclusive); outputs from the 70/20/10 short/medium/long mix."""
    lo, hi = prompt_len
    if not 1 <= lo <= hi:
        raise ValueError(f"invalid prompt_len {prompt_len}")
    rng = random.Random(seed)
    requests: list[BenchRequest] = []
    for _ in range(num_requests):
        prompt = _random_prompt(rng, rng.randint(lo, hi), vocab_size)
        requests.append(BenchRequest(prompt_token_ids=prompt, max_tokens=_sample_skewed_output_len(rng)))
    return requests


def _uniform_len(rng: random.Random, length: int, range_ratio: float) -> int:
    lo = max(1, int(length * (1.0 - range_ratio)))
    hi = max(lo, int(length * (1.0 + range_ratio)))
    return rng.randint(lo, hi)


def random_workload(
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    vocab_size: int = 8192,
    seed: int = 0,
) -> list[BenchRequest]:
    """Input/output lengths uniform in ``[len * (1 - range_ratio), len * (1 + range_ratio)]``."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError("input_len and output_len must be >= 1")
    rng = random.Random(seed)
    requests: list[BenchRequest] = []
    for _ in range(num_requests):
        prompt = _random_prompt(rng, _uniform_len(rng, input_len, range_ratio), vocab_size)
        requests.append(
            BenchRequest(prompt_token_ids=prompt, max_tokens=_uniform_len(rng, output_len, range_ratio))
        )
    return requests
