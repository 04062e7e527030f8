"""The simulator checked against ``pdserve profile --served``'s busy probes (issue 34): prompts sent
one after another while a few long requests decode, replayed as measured, the simulator's TTFT for
each against the one measured.

The probes put the shared-core model (``Simulator._sharing``) to a controlled test: every other
input of the simulator was measured alone (the engine profile) or at low load (the served path's
latency terms), and the probes add known work beside the prompts. On a CPU host whose workers share
the cores, the error says how far the model's fair share of the cores is from what the scheduler
gives a prompt beside a busy decode worker and the front end's bursts (bench/README.md, "The
planner against real runs"). A deployment whose workers have cores of their own should show ~0.
"""

from __future__ import annotations

import math
import random
import statistics

from planner.costs import ModelProfile
from planner.simulator import Deployment, SimRequest, Simulator


def busy_samples(profile: ModelProfile, mode: str) -> list[dict]:
    over = profile.served.get(mode)
    return [s for s in over.samples if s.get("kind") == "busy"] if over is not None else []


def probe_scenario(samples: list[dict], vocab: int = 30000) -> tuple[list[SimRequest], list[SimRequest]]:
    """(the long requests, the probes) of the busy phase, as measured: the long ones sent at 0, each
    probe at its ``sent`` time, a cached probe the same prompt as the fresh one of its length before
    it. Token ids are random (only which prompts share them matters to the simulator)."""
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


def probe_errors(profile: ModelProfile, deployment: Deployment) -> list[float] | None:
    """Per busy probe, simulated / measured TTFT - 1 on ``deployment`` (None: no probes measured)."""
    samples = busy_samples(profile, deployment.mode)
    if not samples:
        return None
    long_ones, probes = probe_scenario(samples, int(profile.model.get("vocab_size") or 30000))
    Simulator(profile, deployment).run(long_ones + probes)
    return [
        (p.first_token - p.arrival) / float(s["seconds"]) - 1 for p, s in zip(probes, samples, strict=True)
    ]


def median_error(errors: list[float]) -> float:
    """The median of per-probe errors, taken on the log scale (a 2x and a 0.5x miss weigh alike)."""
    return math.expm1(statistics.median(math.log1p(e) for e in errors))
