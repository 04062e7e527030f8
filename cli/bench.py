"""``pdserve bench``: load-test any OpenAI-compatible server (the load generator is ``loadgen``)."""

from __future__ import annotations

import argparse

from loadgen.serving_client import add_bench_args


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="load-test any OpenAI-compatible server (TTFT, TPOT, ITL, E2E, goodput)")
    add_bench_args(b)
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from loadgen.serving_client import run as run_load

    result = run_load(args)
    return 0 if all(r["completed"] for r in result["runs"]) else 1
