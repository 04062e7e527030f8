"""The simulator's interference on shared cores, calibrated from busy probes (``planner.interference``):
the calibration finds the value the probes were made with, stays at 0 when nothing calls for it,
and the planner's and the validation's predictions use it."""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest
from synthetic import synthetic_profile

from planner.costs import ServedOverhead
from planner.interference import calibrate, calibrated, probe_error, probe_scenario
from planner.simulator import Deployment, SimRequest, Simulator

MODE = "disaggregated"


def _probes(streams: int = 4) -> list[dict]:
    """The busy phase's samples, TTFT not filled in: each length fresh then cached, 0.4 s apart."""
    out = []
    pairs = [(n, c) for n in (32, 128, 256) for c in (0, (n - 1) // 16 * 16)]
    for i, (length, cached) in enumerate(pairs):
        out.append({"kind": "busy", "prompt": length, "cached": cached, "sent": 0.5 + 0.4 * i})
        out[-1]["seconds"] = 0.0
        out[-1] |= {"streams": streams, "stream_prompt": 32, "stream_tokens": 800}
    return out


def _profile(samples: list[dict]):
    over = ServedOverhead(ttft_s=0.003, cpu_per_request_s=0.002, cpu_per_token_s=3e-4, engine_cores=1.0)
    return replace(synthetic_profile(), served={MODE: replace(over, samples=tuple(samples))})


def _measured_with(interference: float, dep: Deployment) -> list[dict]:
    """Busy samples whose TTFTs are what the simulator gives at ``interference``."""
    samples = _probes()
    long_ones, probes = probe_scenario(samples)
    Simulator(_profile(samples), dep, interference).run(long_ones + probes)
    return [s | {"seconds": p.first_token - p.arrival} for s, p in zip(samples, probes, strict=True)]


@pytest.mark.parametrize("truth", [0.15, 0.6, 2.5])
def test_the_calibration_finds_the_interference_the_probes_ran_under(truth):
    dep = Deployment(1, 1, host_cores=2)
    profile = _profile(_measured_with(truth, dep))
    assert calibrate(profile, dep) == pytest.approx(truth, rel=0.03)
    assert calibrated(profile, dep).interference == pytest.approx(truth, rel=0.03)
    # The probes beside the long ones ran slower than without it: the error at 0 is negative.
    assert probe_error(profile, dep, [s for s in profile.served[MODE].samples], 0.0) < 0


def test_no_interference_without_probes_shared_cores_or_a_slowdown():
    dep = Deployment(1, 1, host_cores=2)
    assert calibrate(_profile([]), dep) == 0.0  # a profile from before the probes
    measured = _measured_with(1.0, dep)
    assert calibrate(_profile(measured), Deployment(1, 1)) == 0.0  # each worker its own device
    faster = [s | {"seconds": s["seconds"] / 3} for s in measured]  # quicker than the model allows
    assert calibrate(_profile(faster), dep) == 0.0


def test_interference_slows_a_prompt_beside_other_work_and_nothing_else():
    dep = Deployment(1, 1, host_cores=2)
    profile = _profile([])

    def run(interference: float, beside: int) -> tuple[float, list[float]]:
        """The probe's TTFT and the long ones' gaps, with ``beside`` long requests decoding."""
        long_ones = [SimRequest(0.0, list(range(100 + i, 132 + i)), 400) for i in range(beside)]
        probe = SimRequest(1.0, list(range(5000, 5256)), 2)
        Simulator(profile, dep, interference).run([*long_ones, probe])
        gaps = [b - a for r in long_ones for a, b in zip(r.token_times, r.token_times[1:])]
        return probe.first_token - probe.arrival, gaps

    alone, _ = run(0.0, 0)
    busy, gaps = run(0.0, 4)
    slowed, slowed_gaps = run(1.0, 4)
    assert slowed > busy * 1.2  # the prompt's computation, beside a decoding worker
    # Decode steps keep their measured served cost (those beside the longer prompt see its core
    # busy longer, and the probe joins their batch later).
    assert statistics.median(slowed_gaps) == pytest.approx(statistics.median(gaps), rel=1e-3)
    assert run(1.0, 0)[0] < busy  # alone, only the front end's own intake is beside it
    assert alone <= busy
