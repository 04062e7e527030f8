"""How much a prompt's computation slows beside other work on cores it shares, before they are full
(issue 34): the simulator's ``interference``, calibrated from ``pdserve profile --served``'s busy
probes.

Measured on a 2-core host (bench/README.md, "The planner against real runs"): with the machine one
core busy on average, a served prefill worker's single torch thread waited in the run queue for
20-27% of its CPU time (``/proc/<tid>/schedstat``), and its steps took 1.3-1.6x the engine profile's,
while the same prompts in a process beside a decoding engine ran at full speed. Work that arrives in
bursts (a request's intake, a decode step's tokens streaming out) lands on the cores while a prompt
runs; an average over a second does not see it. And an engine of two torch threads on two cores
stalls whenever any other thread takes one of them (OpenMP's team waits for its slowest member).

``pdserve profile --served`` sends the TTFT phase's prompts again while a few long requests decode
(``busy`` samples: when each was sent after the long ones, and its TTFT). ``calibrated`` replays that
scenario in the simulator of the deployment being predicted and picks the ``interference`` whose
median TTFT error over the probes is zero (the stretch grows with it, so a bisection finds it). No
busy samples, or a deployment that does not share its cores: 0, the simulator as before.
"""

from __future__ import annotations

import math
import random
import statistics

from planner.costs import ModelProfile
from planner.simulator import Deployment, SimRequest, Simulator

MAX_INTERFERENCE = 16.0  # a prompt 17x slower beside one core of other work: beyond it, a broken probe
_ITERATIONS = 30


def busy_samples(profile: ModelProfile, mode: str) -> list[dict]:
    over = profile.served.get(mode)
    return [s for s in over.samples if s.get("kind") == "busy"] if over is not None else []


def probe_scenario(samples: list[dict], vocab: int = 30000) -> tuple[list[SimRequest], list[SimRequest]]:
    """(the long requests, the probes) of the busy phase, as measured: the long ones sent at 0, each
    probe at its ``sent`` time, a cached probe the same prompt as the fresh one of its length before
    it. Token ids are random (only their sharing matters to the simulator)."""
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    first = samples[0]
    long_ones = [
        SimRequest(0.0, tokens(int(first["stream_prompt"])), int(first["stream_tokens"]))
        for _ in range(int(first["streams"]))
    ]
    probes, fresh = [], {}
    for s in samples:
        n = int(s["prompt"])
        if not s["cached"] or n not in fresh:
            fresh[n] = tokens(n)
        probes.append(SimRequest(float(s["sent"]), fresh[n], 2))
    return long_ones, probes


def probe_error(
    profile: ModelProfile, deployment: Deployment, samples: list[dict], interference: float
) -> float:
    """Median of log(simulated / measured TTFT) over the probes, at ``interference``."""
    long_ones, probes = probe_scenario(samples, int(profile.model.get("vocab_size") or 30000))
    Simulator(profile, deployment, interference).run(long_ones + probes)
    return statistics.median(
        math.log(max(p.first_token - p.arrival, 1e-9) / max(float(s["seconds"]), 1e-9))
        for p, s in zip(probes, samples, strict=True)
    )


def calibrate(profile: ModelProfile, deployment: Deployment) -> float:
    """The ``interference`` under which the simulator reproduces the busy probes' median TTFT."""
    samples = busy_samples(profile, deployment.mode)
    if not samples or deployment.host_cores is None:
        return 0.0
    if probe_error(profile, deployment, samples, 0.0) >= 0:
        return 0.0  # the probes ran no slower than the simulator says without it
    low, high = 0.0, 1.0
    while probe_error(profile, deployment, samples, high) < 0:
        low, high = high, high * 2
        if high > MAX_INTERFERENCE:
            return MAX_INTERFERENCE
    for _ in range(_ITERATIONS):
        mid = (low + high) / 2
        if probe_error(profile, deployment, samples, mid) < 0:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def calibrated(profile: ModelProfile, deployment: Deployment) -> Simulator:
    """A simulator of ``deployment`` with its interference calibrated (0 when nothing to go by)."""
    return Simulator(profile, deployment, calibrate(profile, deployment))
