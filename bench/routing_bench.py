"""Routing decision latency: hash a 4k-token prompt, look it up in a 100k-entry index, pick a pair.

Builds the router's real ``PrefixIndex`` with 16 workers (8 prefill, 8 decode) holding 100k block
entries in all (many tenants' long prompts, some shared by several workers), then times
``Router.route`` — the engines' block hashing included — for 4k-token prompts whose cached prefix
varies, per policy. One core, no Redis round trip (the index is in-process by design).

    python -m bench.routing_bench [--decisions 3000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from engine.block_hash import hash_blocks
from registry.cluster_view import ClusterView
from registry.schema import WorkerRecord
from router.policies import POLICIES
from router.router import Router

BLOCK = 16


def build_view(
    num_workers: int, target_entries: int, prompt_len: int, seed: int
) -> tuple[ClusterView, list[list[int]]]:
    rng = random.Random(seed)
    view = ClusterView("redis://unused")  # never started: the index is filled directly
    half = num_workers // 2
    view.workers = {
        f"{role}{i}": WorkerRecord(
            worker_id=f"{role}{i}",
            role=role,
            address="-",
            epoch=1,
            num_blocks=100_000,
            num_free_blocks=rng.randrange(1000, 100_000),
            queued_prompt_tokens=rng.randrange(0, 8000),
        )
        for role, n in (("prefill", half), ("decode", num_workers - half))
        for i in range(n)
    }
    ids = list(view.workers)
    tenants: list[list[int]] = []
    entries = 0
    while entries < target_entries:
        prompt = [rng.randrange(10, 32000) for _ in range(prompt_len)]
        tenants.append(prompt)
        hashes = hash_blocks(prompt, BLOCK)
        holders = rng.sample(ids, rng.choice([1, 1, 2, 3]))
        for w in holders:
            view.index.replace(
                w, 1, 0, view.index.blocks_of(w) | set(hashes[: rng.randrange(len(hashes) // 4, len(hashes))])
            )
        entries = view.index.size
    return view, tenants


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--entries", type=int, default=100_000)
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--decisions", type=int, default=3000)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    print(f"building an index of {args.entries} entries over {args.workers} workers ...", file=sys.stderr)
    view, tenants = build_view(args.workers, args.entries, args.prompt_len, seed=0)
    rng = random.Random(1)
    prompts = []
    for _ in range(args.decisions):  # a cached prefix of varying length, then a fresh tail
        base = rng.choice(tenants)
        cut = rng.randrange(0, args.prompt_len)
        prompts.append(base[:cut] + [rng.randrange(10, 32000) for _ in range(args.prompt_len - cut)])
    results = {"index_entries": view.index.size, "workers": args.workers, "prompt_len": args.prompt_len}
    for policy in POLICIES:
        router = Router(view, policy)
        for prompt in prompts[:50]:
            router.route(prompt)
        lat = []
        start = time.perf_counter()
        for prompt in prompts:
            t = time.perf_counter()
            router.route(prompt)
            lat.append(time.perf_counter() - t)
        total = time.perf_counter() - start
        lat.sort()
        r = {
            "p50_ms": statistics.median(lat) * 1e3,
            "p99_ms": lat[int(0.99 * len(lat))] * 1e3,
            "decisions_per_s": len(lat) / total,
        }
        results[policy] = r
        print(
            f"{policy:<12} p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms  {r['decisions_per_s']:.0f} decisions/s"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
