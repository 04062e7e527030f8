"""SamplingParams: bad values are refused at construction with a message naming the field."""

from __future__ import annotations

import math
from typing import Any

import pytest

from engine.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1.0}, r"temperature must be a finite number >= 0, got -1\.0"),
        ({"temperature": math.nan}, r"temperature must be a finite number >= 0, got nan"),
        ({"temperature": math.inf}, r"temperature must be a finite number >= 0, got inf"),
        ({"temperature": "0.7"}, r"temperature must be a finite number >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0\.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1\.5"),
        ({"min_p": 2.0}, r"min_p must be in \[0, 1\], got 2\.0"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
        ({"n": 0}, rf"n must be in \[1, {MAX_N}\], got 0"),
        ({"n": MAX_N + 1}, rf"n must be in \[1, {MAX_N}\]"),
        ({"max_tokens": 0}, r"max_tokens must be >= 1, got 0"),
        ({"logprobs": MAX_LOGPROBS + 1}, rf"logprobs must be in \[0, {MAX_LOGPROBS}\], got 21"),
        ({"logprobs": -1}, r"logprobs must be in \[0, 20\]"),
        ({"seed": -1}, r"seed must be in \[0, 2\*\*63\), got -1"),
        ({"seed": 2**63}, r"seed must be in \[0, 2\*\*63\)"),
        ({"n": True}, r"n must be an integer, got True"),
        ({"max_tokens": True}, r"max_tokens must be an integer, got True"),
        ({"top_k": False}, r"top_k must be an integer, got False"),
        ({"top_k": -5}, r"top_k must be -1 or 0 \(off\) or a positive integer, at most 2147483647, got -5"),
        ({"top_k": 2**64}, r"top_k must be .* at most 2147483647, got 18446744073709551616"),
        ({"seed": True}, r"seed must be an integer, got True"),
        ({"logprobs": True}, r"logprobs must be an integer, got True"),
        ({"temperature": True}, r"temperature must be a finite number >= 0, got True"),
        ({"max_tokens": 1.5}, r"max_tokens must be an integer, got 1\.5"),
        ({"stop": ""}, r"stop strings must be non-empty strings, got ''"),
        ({"stop": ["ok", ""]}, r"stop strings must be non-empty strings, got ''"),
        ({"stop": [3]}, r"stop strings must be non-empty strings, got 3"),
        ({"stop_token_ids": [-1]}, r"stop_token_ids must be >= 0, got -1"),
        ({"stop_token_ids": [True]}, r"stop_token_ids entries must be an integer"),
    ],
)
def test_invalid_value_is_refused_with_a_clear_message(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_defaults_are_valid_and_documented() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.seed, p.max_tokens, p.logprobs) == (None, 16, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert not p.greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0},
        {"top_p": 1e-9, "min_p": 1.0, "top_k": -1},
        {"n": MAX_N, "logprobs": 0},
        {"logprobs": MAX_LOGPROBS, "seed": 0},
        {"seed": 2**63 - 1, "max_tokens": 1},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict[str, Any]) -> None:
    SamplingParams(**kwargs)


def test_stop_given_as_a_string_becomes_a_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_stop_lists_are_copied_not_shared_with_the_caller() -> None:
    stops = ["x"]
    p = SamplingParams(stop=stops)
    stops.append("y")
    assert p.stop == ["x"]


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"temperature": 0.0}, True),
        ({"temperature": 0.8, "top_k": 1}, True),
        ({"temperature": 0.8}, False),
        ({"temperature": 0.8, "top_k": 2}, False),
        ({"temperature": 1e-6}, True),  # under 1e-5, as vLLM: logits / temperature would overflow
        ({"temperature": 1e-4}, False),
    ],
)
def test_greedy_means_temperature_zero_or_top_k_one(kwargs: dict[str, Any], greedy: bool) -> None:
    assert SamplingParams(**kwargs).greedy is greedy
