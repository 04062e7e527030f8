"""Host time per step of a churning batch, with and without the steady-batch paths.

``bench.host_overhead`` times a batch that never changes (every sequence decodes to the end
together), the case the steady-batch paths (``engine.steady_decodes``, ``engine.repeat_inputs``,
``StepResults._update_steady``) are built for. Here ``--batch`` sequences of ``--context`` tokens run
with staggered lengths, one ending every ``--every`` steps, each replaced at once by a new request
(a ``--prompt``-token prompt, prefilled in the next step): the batch changes every few steps, as
under serving load. Each run times ``--steps`` steps as the engine process runs them (step plus
channel encode), alternately with the steady paths on and switched off, and prints both.

    python -m bench.host_overhead_churn [--every 4] [--runs 3] [--batch 256] [--context 1024] [--overlap] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _one(args: argparse.Namespace, steady: bool) -> tuple[float, float]:
    """(mean, p50) ms of a churning batch's steps, in this process."""
    import torch

    from bench import host_overhead as H
    from engine import SamplingParams

    torch.set_num_threads(1)
    if not steady:  # the per-request paths alone
        from engine.repeat_inputs import RepeatInputs
        from engine.scheduler import Scheduler
        from engine.scheduler_results import StepResults

        Scheduler._capture_steady = lambda self, *a: None
        RepeatInputs.capture = classmethod(lambda cls, *a: None)
        StepResults._update_steady = lambda self, *a: False
    longest = 10 + args.batch * args.every + args.steps
    max_len = max(args.context, args.prompt) + longest + 16
    checkpoint, _ = H.make_checkpoint(Path(tempfile.mkdtemp()), max_len, False)
    blocks = math.ceil(args.batch * -(-max_len // H.BLOCK_SIZE) / 0.99) + 8
    overlap = {"async_scheduling": "on"} if args.overlap else {}
    core = H.build_engine(
        checkpoint, False, args.batch, max_len, blocks, "fifo", attention_backend="triton", **overlap
    )
    vocab = H.VOCAB - 3

    def add(i: int, length: int, max_tokens: int) -> None:
        prompt = [3 + (7 * i + j) % vocab for j in range(length)]
        core.add_request(
            f"s{i}", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        )

    for i in range(args.batch):  # sequence i ends after about (i + 1) * every steps
        add(i, args.context, 10 + (i + 1) * args.every)
    while any(r.num_computed_tokens < r.prompt_len for r in core.scheduler.requests.values()):
        core.step()
    step, _ = H.channel_step(core)
    added = args.batch
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
        while len(core.scheduler.requests) < args.batch:
            add(added, args.prompt, longest)
            added += 1
    return statistics.mean(times) * 1e3, statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--every", type=int, default=4, help="a sequence ends (and one arrives) every N steps"
    )
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=64, help="the arriving requests' prompt length")
    parser.add_argument("--overlap", action="store_true", help="the engine with async_scheduling on")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--runs", type=int, default=3, help="alternated runs of each side")
    parser.add_argument("--json", type=Path, help="also write the runs and the ratio here")
    parser.add_argument("--side", choices=["on", "off"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.every, args.batch, args.context, args.prompt, args.steps, args.runs) < 1:
        parser.error("every number must be positive")
    if args.side:  # one side, in a process of its own (the switched-off paths are patched in)
        print(*_one(args, args.side == "on"))
        return
    got: dict[str, list[tuple[float, float]]] = {"on": [], "off": []}
    keep = ("--batch", "--context", "--prompt", "--steps", "--every")  # what each side needs
    passed = [f"{flag}={getattr(args, flag[2:])}" for flag in keep] + ["--overlap"] * args.overlap
    for run in range(args.runs):
        for side in ("on", "off"):
            out = subprocess.run(
                [sys.executable, "-m", "bench.host_overhead_churn", *passed, "--side", side],
                capture_output=True, text=True,
            )  # fmt: skip
            if out.returncode:
                raise RuntimeError(f"the {side!r} side failed:\n{out.stderr[-2000:]}")
            mean, p50 = map(float, out.stdout.split())
            got[side].append((mean, p50))
            print(f"run {run + 1} steady paths {side:3s}: mean {mean:.3f} ms, p50 {p50:.3f} ms", flush=True)
    on, off = (min(m for m, _ in got[s]) for s in ("on", "off"))
    print(
        f"batch {args.batch} x {args.context}, one ends every {args.every} steps: min mean {on:.3f} ms with the "
        f"steady paths, {off:.3f} without ({on / off:.2f}x)"
    )
    if args.json:
        shape = {
            k: getattr(args, k) for k in ("batch", "context", "prompt", "steps", "every", "runs", "overlap")
        }
        runs = {side: [{"mean_ms": m, "p50_ms": p} for m, p in got[side]] for side in got}
        result = {**shape, "runs": runs, "min_mean_ms": {"on": on, "off": off}, "on_over_off": on / off}
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
