"""How fast this machine is right now: a fixed piece of engine work, timed.

A shared VM's cores do not run at one speed. On the 2-core machine the planner is validated on, the
same 128-token prefill (1 torch thread, nothing else running) took 91 to 125 ms over three minutes,
and 137 ms and 86 ms on two days (bench/README.md, the planner section). A profile measured at one
speed and a served run at another differ by that much whatever a simulator does, so
``bench.planner_validation`` records this probe's time around each of its measurements (the
profiles, the served overheads, every replay), and ``python -m bench.speed_probe`` tells whether
the machine is steady enough for a benchmark before one is run.

``SpeedProbe(model).seconds()``: two prefills of 128 fresh tokens and eight decode steps at batch 8,
on an engine of its own at one torch thread, the faster of two runs (about a second in all). Prompts
are fresh each time (random ids), so the prefix cache never shortens the work.

    python -m bench.speed_probe [--model DIR] [--every 15] [--count 20]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

PREFILL_TOKENS = 128
DECODE_BATCH = 8
DECODE_STEPS = 8
RUNS = 2


class SpeedProbe:
    def __init__(self, model: str, seed: int = 7) -> None:
        from engine import EngineConfig, EngineCore

        self.core = _at_one_thread(
            lambda: EngineCore(EngineConfig(model=model, num_blocks=256, cpu_threads=1))
        )
        self.vocab = self.core.spec.vocab_size
        self.rng = random.Random(seed)
        self.n = 0

    def seconds(self) -> float:
        """The probe's work timed now: the faster of ``RUNS`` runs."""
        return _at_one_thread(lambda: min(self._once() for _ in range(RUNS)))

    def around(self, fn):
        """``fn()``, and the probe's mean seconds just before and just after it: (result, seconds)."""
        before = self.seconds()
        result = fn()
        return result, statistics.fmean((before, self.seconds()))

    def _once(self) -> float:
        from engine import SamplingParams

        start = time.perf_counter()
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        for _ in range(2):
            self._run([self._prompt(PREFILL_TOKENS)], one)
        steps = SamplingParams(temperature=0, max_tokens=DECODE_STEPS + 1, ignore_eos=True)
        self._run([self._prompt(16) for _ in range(DECODE_BATCH)], steps)
        return time.perf_counter() - start

    def _prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(10, self.vocab) for _ in range(n)]

    def _run(self, prompts: list[list[int]], params) -> None:
        for p in prompts:
            self.n += 1
            self.core.add_request(f"speed-{self.n}", p, params)
        while self.core.has_work():
            self.core.step()


def _at_one_thread(fn):
    """``fn()`` with torch at one intra-op thread, the caller's count restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> None:
    from bench.offline_throughput import DEFAULT_MODEL_DIR, ensure_model

    p = argparse.ArgumentParser(prog="python -m bench.speed_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="checkpoint (created when missing)")
    p.add_argument("--every", type=float, default=15.0, help="seconds between probes")
    p.add_argument("--count", type=int, default=20, help="probes to take")
    args = p.parse_args(argv)
    probe = SpeedProbe(str(ensure_model(Path(args.model))))
    times = []
    for i in range(args.count):
        if i:
            time.sleep(args.every)
        times.append(probe.seconds())
        print(f"{time.strftime('%H:%M:%S')}  {times[-1] * 1e3:7.1f} ms", flush=True)
    if len(times) > 1:
        print(f"slowest / fastest: {max(times) / min(times):.2f}x over {len(times)} probes")


if __name__ == "__main__":
    main()
