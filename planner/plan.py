"""``pdserve plan``'s search: the fewest workers that serve a traffic within its SLOs (issue 34).

Every layout up to ``max_workers`` GPUs (aggregated, and P prefill + D decode) and every candidate
local-prefill threshold runs through the simulator on the same requests; a layout *meets* the traffic
when its TTFT p90 and ITL p50 are within the SLOs and it keeps up with the arrivals (good requests
completed at least at ``keep_up`` of the rate they arrive, both measured alike: ``pace``). The
recommendation is the one that meets it with the fewest
workers, then the most goodput. An SLO no layout can meet is an error that says how close the best
came; one below what a lone request takes on this hardware is refused before any search.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from planner.costs import ModelProfile
from planner.simulator import Deployment, Simulator, Summary, summarize
from planner.traffic import Traffic

THRESHOLDS = (0, 64, 256, 1024)  # local-prefill thresholds tried (0: every prompt goes to a prefill worker)


class PlanError(ValueError):
    """No layout serves the traffic within its SLOs (or none ever could)."""


@dataclass(frozen=True)
class Candidate:
    deployment: Deployment
    summary: Summary
    meets: bool
    arriving: float  # the simulated arrivals' rate, requests/s (``pace``)
    completing: float  # good requests completed per second, measured as ``arriving`` is

    @property
    def workers(self) -> int:
        return self.deployment.prefill + self.deployment.decode

    def describe(self) -> str:
        d = self.deployment
        layout = f"{d.decode} aggregated" if d.prefill == 0 else f"{d.prefill}P + {d.decode}D"
        if d.prefill and d.local_prefill_tokens:
            layout += f", local prefill <= {d.local_prefill_tokens}"
        return layout


def check_feasible(profile: ModelProfile, traffic: Traffic) -> None:
    """Refuse traffic the model cannot serve at all (a request longer than its context: the server
    answers it 400), and SLOs that even an idle worker cannot meet (before searching)."""
    context = profile.model.get("max_model_len")
    longest = max(traffic.generate(), key=lambda r: len(r.prompt) + r.output_len, default=None)
    if context and longest is not None and len(longest.prompt) + longest.output_len > context:
        raise PlanError(
            f"the traffic's longest request needs {len(longest.prompt)} prompt + {longest.output_len} "
            f"output tokens, above the profiled model's context of {context}: the server refuses it"
        )
    slo = traffic.slo
    if slo.ttft_p90_s is not None:
        alone = profile.prefill_s(round(traffic.prompt.mean))
        if alone > slo.ttft_p90_s:
            raise PlanError(
                f"impossible TTFT SLO: a lone {traffic.prompt.mean:.0f}-token prompt takes {alone:.3f} s to "
                f"prefill on this hardware, above ttft_p90_s = {slo.ttft_p90_s} s"
            )
    if slo.itl_p50_s is not None:
        alone = profile.decode_step_s(1, traffic.prompt.mean)
        if alone > slo.itl_p50_s:
            raise PlanError(
                f"impossible ITL SLO: one sequence's decode step takes {alone * 1e3:.2f} ms on this hardware, "
                f"above itl_p50_s = {slo.itl_p50_s * 1e3:.2f} ms"
            )


def evaluate(
    profile: ModelProfile, traffic: Traffic, deployment: Deployment, keep_up: float = 0.95
) -> Candidate:
    requests = Simulator(profile, deployment).run(traffic.generate())
    slo = traffic.slo
    summary = summarize(requests, slo.ttft_p90_s, slo.itl_p50_s)
    arriving, completing = pace(requests, summary.good)
    meets = (
        (slo.ttft_p90_s is None or summary.ttft_p90 <= slo.ttft_p90_s)
        and (slo.itl_p50_s is None or summary.itl_p50 <= slo.itl_p50_s)
        and completing >= keep_up * arriving
    )
    return Candidate(deployment, summary, meets, arriving, completing)


def pace(requests, good: int) -> tuple[float, float]:
    """(arriving, completing): requests per second arriving, and good requests per second completed,
    each the slope of its sorted times over the same requests. A latency that every request pays
    shifts the completions and leaves their pace alone; a backlog that grows stretches it. One
    arrival, or all at once, has no rate to keep up with (infinite: the SLOs alone decide)."""
    ranks = range(len(requests))
    arrivals = sorted(r.arrival for r in requests)
    if len(requests) < 2 or arrivals[-1] <= arrivals[0]:
        return math.inf, math.inf
    arriving = 1 / statistics.linear_regression(ranks, arrivals).slope
    completing = 1 / statistics.linear_regression(ranks, sorted(r.done for r in requests)).slope
    return arriving, completing * good / len(requests)


def layouts(max_workers: int, thresholds=THRESHOLDS, host_cores: int | None = None) -> list[Deployment]:
    out = [Deployment(0, d, host_cores=host_cores) for d in range(1, max_workers + 1)]
    for total in range(2, max_workers + 1):
        for p in range(1, total):
            out += [
                Deployment(p, total - p, local_prefill_tokens=t, host_cores=host_cores) for t in thresholds
            ]
    return out


def plan(
    profile: ModelProfile,
    traffic: Traffic,
    max_workers: int = 8,
    progress=None,
    host_cores: int | None = None,
) -> tuple[Candidate, list[Candidate]]:
    """(the recommendation, every candidate evaluated), searching by total workers, fewest first, and
    stopping after the first total that has a layout meeting the traffic. ``host_cores``: the workers
    share that many cores of one host (a CPU deployment)."""
    if max_workers < 1:
        raise PlanError(f"max_workers must be at least 1, got {max_workers}")
    check_feasible(profile, traffic)
    seen: list[Candidate] = []
    by_total: dict[int, list[Deployment]] = {}
    for d in layouts(max_workers, host_cores=host_cores):
        by_total.setdefault(d.prefill + d.decode, []).append(d)
    for total in sorted(by_total):
        batch = [evaluate(profile, traffic, d) for d in by_total[total]]
        seen += batch
        if progress is not None:
            best = max(batch, key=lambda c: c.summary.goodput)
            progress(f"{total} worker(s): best {best.describe()}, goodput {best.summary.goodput:.2f} req/s")
        good = [c for c in batch if c.meets]
        if good:
            return max(good, key=lambda c: (c.summary.goodput, -c.summary.ttft_p90)), seen
    best = max(seen, key=lambda c: (c.summary.goodput, -c.summary.ttft_p90))
    s = best.summary
    raise PlanError(
        f"no layout of up to {max_workers} workers meets the traffic: the best, {best.describe()}, "
        f"reached TTFT p90 {s.ttft_p90:.3f} s, ITL p50 {s.itl_p50 * 1e3:.1f} ms, goodput "
        f"{best.completing:.2f} good requests/s completed of {best.arriving:.2f} req/s arriving "
        "(raise --max-workers or relax the SLOs)"
    )
