"""Scheduler overhead per decode step, with a fake model runner (no model, no GPU).

Sets up ``--num-seqs`` sequences (prompts of about ``--prompt-len`` tokens, outputs long enough that
none finishes), steps until every one of them is decoding, then times ``schedule()`` and
``update()`` over ``--steps`` decode steps. The fake runner's own time is measured separately and
left out of the headline number, which is what the scheduler adds to every step of a real engine.

    python -m bench.scheduler_overhead [--steps 500] [--repeats 3] [--json PATH] [--profile 25]

:class:`FakeRunner` is also what the scheduler's unit tests drive the scheduler with.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import math
import pstats
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.fake_runner import FakeRunner
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from loadgen.workloads import random_workload


@dataclass(frozen=True, slots=True)
class OverheadResult:
    num_seqs: int
    steps: int
    mean_ms: float  # schedule() + update() per step
    p50_ms: float
    p99_ms: float
    schedule_mean_ms: float
    update_mean_ms: float
    runner_mean_ms: float  # the fake runner, excluded from the numbers above


def build_scheduler(
    num_seqs: int, prompt_len: int, block_size: int, max_tokens: int, max_num_batched_tokens: int
) -> Scheduler:
    max_len = int(prompt_len * 1.1) + 1 + max_tokens
    kv = KVCacheManager(num_seqs * (-(-max_len // block_size)) + 64, block_size)
    sched = Scheduler(
        kv,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=num_seqs,
        max_model_len=max_len,
    )
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, w in enumerate(random_workload(num_seqs, prompt_len, max_tokens, range_ratio=0.1, seed=0)):
        sched.add(Request(f"seq-{i}", w.prompt_token_ids, params, seed=i, eos_token_ids=frozenset()))
    return sched


def warm_up(sched: Scheduler, runner: FakeRunner, max_steps: int = 1000) -> int:
    """Step until every sequence is running and one token behind (decoding); returns the steps."""
    for step in range(max_steps):
        if not sched.waiting and all(r.num_tokens - r.num_computed_tokens == 1 for r in sched.running):
            return step
        out = sched.schedule()
        sched.update(out, runner(out))
    raise RuntimeError(f"sequences still prefilling after {max_steps} steps")


def measure(
    num_seqs: int = 256,
    prompt_len: int = 128,
    block_size: int = 16,
    steps: int = 500,
    max_num_batched_tokens: int = 8192,
    profiler: cProfile.Profile | None = None,
) -> OverheadResult:
    sched = build_scheduler(num_seqs, prompt_len, block_size, steps + 100, max_num_batched_tokens)
    runner = FakeRunner()
    warm_up(sched, runner)
    sched_ms: list[float] = []
    update_ms: list[float] = []
    runner_ms: list[float] = []
    clock = time.perf_counter
    gc.collect()
    if profiler is not None:
        profiler.enable()
    for _ in range(steps):
        t0 = clock()
        out = sched.schedule()
        t1 = clock()
        result = runner(out)
        t2 = clock()
        seq_outs = sched.update(out, result)
        t3 = clock()
        sched_ms.append((t1 - t0) * 1e3)
        runner_ms.append((t2 - t1) * 1e3)
        update_ms.append((t3 - t2) * 1e3)
        if len(out.num_scheduled_tokens) != num_seqs or any(o.finished for o in seq_outs):
            raise RuntimeError("a sequence stopped decoding during the measurement")
    if profiler is not None:
        profiler.disable()
    total = sorted(s + u for s, u in zip(sched_ms, update_ms))
    return OverheadResult(
        num_seqs=num_seqs,
        steps=steps,
        mean_ms=statistics.fmean(total),
        p50_ms=total[len(total) // 2],
        p99_ms=total[min(len(total) - 1, math.ceil(0.99 * len(total)) - 1)],
        schedule_mean_ms=statistics.fmean(sched_ms),
        update_mean_ms=statistics.fmean(update_ms),
        runner_mean_ms=statistics.fmean(runner_ms),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=1, help="independent runs, each from scratch")
    parser.add_argument("--target-ms", type=float, default=0.5)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N", help="cProfile the timed steps; print the top N"
    )
    args = parser.parse_args(argv)

    profiler = cProfile.Profile() if args.profile else None
    results = []
    for i in range(args.repeats):
        r = measure(
            args.num_seqs,
            args.prompt_len,
            args.block_size,
            args.steps,
            args.max_num_batched_tokens,
            profiler if i == 0 else None,
        )
        results.append(r)
        verdict = "ok" if r.mean_ms <= args.target_ms else f"above the {args.target_ms} ms target"
        print(
            f"run {i + 1}: {r.num_seqs} decoding seqs, {r.steps} steps: schedule+update "
            f"mean {r.mean_ms:.3f} ms, p50 {r.p50_ms:.3f} ms, p99 {r.p99_ms:.3f} ms ({verdict}); "
            f"schedule {r.schedule_mean_ms:.3f} ms, update {r.update_mean_ms:.3f} ms, "
            f"fake runner {r.runner_mean_ms:.3f} ms (excluded)"
        )
    if profiler is not None:
        buf = io.StringIO()
        stats = pstats.Stats(profiler, stream=buf)
        stats.sort_stats("tottime").print_stats(args.profile)
        print(buf.getvalue())
    if args.json is not None:
        args.json.write_text(json.dumps({"target_ms": args.target_ms, "runs": [asdict(r) for r in results]}))


if __name__ == "__main__":
    main()
