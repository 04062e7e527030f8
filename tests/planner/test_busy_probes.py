"""The simulator against busy probes (``planner.busy_probes``): the measured scenario is rebuilt as it
ran (long requests first, each probe when it was sent, a cached probe repeating its fresh prompt),
and the error is the simulator's TTFT against the measured one."""

from __future__ import annotations

from dataclasses import replace

import pytest
from synthetic import synthetic_profile

from planner.busy_probes import median_error, probe_errors, probe_scenario
from planner.costs import ServedOverhead
from planner.simulator import Deployment, Simulator

MODE = "disaggregated"


def _samples(streams: int = 4) -> list[dict]:
    """The busy phase's samples, TTFT not filled in: each length fresh then cached, 0.4 s apart."""
    pairs = [(n, c) for n in (32, 128, 256) for c in (0, (n - 1) // 16 * 16)]
    out = []
    for i, (length, cached) in enumerate(pairs):
        out.append({"kind": "busy", "prompt": length, "cached": cached, "sent": 0.5 + 0.4 * i})
        out[-1] |= {"seconds": 1.0, "streams": streams, "stream_prompt": 32, "stream_tokens": 800}
    return out


def _profile(samples: list[dict]):
    over = ServedOverhead(ttft_s=0.003, cpu_per_request_s=0.002, cpu_per_token_s=3e-4, engine_cores=1.0)
    return replace(synthetic_profile(), served={MODE: replace(over, samples=tuple(samples))})


def test_the_scenario_is_rebuilt_as_measured():
    long_ones, probes = probe_scenario(_samples(streams=3))
    assert [(r.arrival, len(r.prompt), r.output_len) for r in long_ones] == [(0.0, 32, 800)] * 3
    assert [(r.arrival, len(r.prompt), r.output_len) for r in probes] == [
        (pytest.approx(0.5 + 0.4 * i), n, 2) for i, n in enumerate((32, 32, 128, 128, 256, 256))
    ]
    assert probes[1].prompt == probes[0].prompt and probes[3].prompt == probes[2].prompt  # cached repeats
    assert len({tuple(r.prompt) for r in long_ones + probes}) == 3 + 3  # nothing else shared


def test_the_error_is_the_simulators_ttft_against_the_measured_one():
    dep = Deployment(1, 1, host_cores=2)
    samples = _samples()
    long_ones, probes = probe_scenario(samples)
    Simulator(_profile(samples), dep).run(long_ones + probes)
    exact = [s | {"seconds": p.first_token - p.arrival} for s, p in zip(samples, probes, strict=True)]
    assert probe_errors(_profile(exact), dep) == pytest.approx([0.0] * 6, abs=1e-9)
    twice = [s | {"seconds": 2 * s["seconds"]} for s in exact]  # the probes ran half as fast
    assert probe_errors(_profile(twice), dep) == pytest.approx([-0.5] * 6)
    # The prompts beside the long ones wait for their decode worker's cores: shared, they take longer.
    assert min(probe_errors(_profile(exact), Deployment(1, 1))) < 0
    assert probe_errors(_profile([]), dep) is None  # a profile from before the probes


def test_the_median_error_weighs_a_miss_by_its_ratio():
    assert median_error([1.0, -0.5]) == pytest.approx(0.0)  # 2x over and 2x under
    assert median_error([-0.5, -0.5, 3.0]) == pytest.approx(-0.5)
