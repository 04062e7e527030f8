"""The engine alone on the zero-cost model, fed in cohorts or staggered (``bench.served_path``'s
``engine`` and ``engine_staggered`` feeds), for a fixed number of requests: the workload that
``bench/step_instructions_ab.sh`` runs under valgrind's callgrind to count the host's instructions
per step. On this VM wall time moves 1.4x within minutes; two instruction counts of the same code
agree within about 1% per step.

    python -m bench.step_instructions staggered 1500     # prints the steps it ran
    python -m bench.step_instructions cohorts 1500 --async-scheduling on
"""

from __future__ import annotations

import argparse

import torch

from bench.serving_comparisons import engine_closed_loop, engine_staggered_loop
from engine import EngineConfig, EngineCore, SamplingParams


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step_instructions", description=__doc__)
    p.add_argument("feed", choices=["cohorts", "staggered"])
    p.add_argument("requests", type=int, help="measured requests (0: start-up and warm-up alone)")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--async-scheduling", choices=["off", "on"], default="off", help="overlapped steps")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    core = EngineCore(
        EngineConfig(
            model="pdserve/zero-cost", num_blocks=2048, cpu_threads=1, async_scheduling=a.async_scheduling
        )
    )
    params = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    prompts = [[1 + (i * 7 + j) % 500 for j in range(16)] for i in range(max(a.requests, 64))]
    engine_closed_loop(core, prompts[:64], params, concurrency=32)  # warm-up, in both feeds
    before = core.stats().num_steps
    if a.requests:
        loop = engine_staggered_loop if a.feed == "staggered" else engine_closed_loop
        loop(core, prompts[: a.requests], params, concurrency=32)
    steps = core.stats().num_steps - before
    print(f"steps {steps}")
    return steps


if __name__ == "__main__":
    main()
