"""cache_aware vs round_robin over HTTP on the multi-tenant prefix workload, and its variants.

Each variant runs the full stack (``pdserve serve``: HTTP ingress, router, 2 prefill + 1 decode
workers, embedded Redis) once per policy, with the same requests: ``T`` tenants, each a shared
``P``-token system prompt, every request one of them plus a unique 32-token question, 8 output
tokens, ``C`` clients back to back. TTFT and throughput are measured at the HTTP client.

Each prefill worker's KV pool holds about half of the tenants' prompts, plus room for the requests
in flight (``--prefill-engine '{"num_blocks": N}'``): the working set is larger than one worker's
cache and fits the pool's, the regime of a busy production pool, where sending a tenant where its
prefix lives is what keeps it cached. The ``ample cache`` variant gives every worker room for all
tenants (only cold misses and load balance differ there); ``hot tenants`` draws tenants from a
Zipf distribution. Before each measured run, requests with unrelated prompts warm the processes
(compiled paths, connections), then one request per tenant, routed by the policy under test, puts
each prefix somewhere: what is measured is the steady state, where the policy decides whether a
tenant's next request finds its prefix.

    python -m bench.prefix_routing [--quick] [--variants headline,tenants_32,...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.serving_harness import VOCAB, bench_args, serving
from loadgen.serving_client import run_load
from loadgen.serving_datasets import ServingRequest, prefix_dataset
from loadgen.workloads import random_workload

RESULTS = Path(__file__).parent / "results"
BLOCK = 16  # the default block size
SUFFIX = 32
OUTPUT = 8


@dataclass(frozen=True)
class Variant:
    name: str
    tenants: int = 8
    prefix_len: int = 512
    concurrency: int = 8
    skew: float = 0.0
    ample_cache: bool = False

    def prefill_blocks(self) -> int | None:
        """Half the tenants' prompts, two more for cold starts, and each client's own blocks."""
        if self.ample_cache:
            return None
        per_prefix = -(-self.prefix_len // BLOCK)
        return -(-self.tenants * per_prefix // 2) + 2 * per_prefix + self.concurrency * (SUFFIX // BLOCK + 2)


VARIANTS = {
    v.name: v
    for v in (
        Variant("headline"),
        Variant("tenants_4", tenants=4),
        Variant("tenants_32", tenants=32),
        Variant("prefix_256", prefix_len=256),
        Variant("prefix_2048", prefix_len=2048),  # the default tiny model has a 4k context
        Variant("concurrency_4", concurrency=4),
        Variant("concurrency_32", concurrency=32),
        Variant("hot_tenants", skew=1.2),
        Variant("ample_cache", ample_cache=True),
    )
}


def requests_for(v: Variant, quick: bool, seed: int = 0) -> list[ServingRequest]:
    n = max(48 if quick else 128, 4 * v.concurrency)
    return prefix_dataset(n, v.tenants, v.prefix_len, SUFFIX, OUTPUT, VOCAB, seed, skew=v.skew)


def warmup_requests(v: Variant) -> list[ServingRequest]:
    """Prompts of the same length sharing nothing with the tenants' (a different seed)."""
    reqs = random_workload(2 * v.concurrency, v.prefix_len + SUFFIX, OUTPUT, 0.0, VOCAB, seed=12345)
    return [ServingRequest(r.prompt_token_ids, r.max_tokens) for r in reqs]


def tenant_requests(v: Variant) -> list[ServingRequest]:
    """One request per tenant (its prefix, a question of its own), the run's own routing deciding
    where each prefix first lands: the measured run then sees the steady state, not the tenants'
    first arrivals, which are cold misses under any policy and at 8 tenants would be the p99."""
    reqs = prefix_dataset(8 * v.tenants, v.tenants, v.prefix_len, SUFFIX, OUTPUT, VOCAB, 0, skew=v.skew)
    first: dict[int, ServingRequest] = {}
    for r in reqs:
        first.setdefault(r.tenant, r)
    return [
        ServingRequest([*r.prompt[: v.prefix_len], *range(20, 20 + SUFFIX)], OUTPUT) for r in first.values()
    ]


def run_variant(v: Variant, quick: bool) -> dict:
    args = bench_args(warmup=0, ignore_eos=True, vocab_size=VOCAB, no_progress=False)
    runs = {}
    for policy in ("cache_aware", "round_robin"):
        flags = ["--prefill", "2", "--decode", "1", "--policy", policy, "--worker-cpus", "0.5"]
        blocks = v.prefill_blocks()
        if blocks is not None:
            flags += ["--prefill-engine", json.dumps({"num_blocks": blocks})]
        with serving(*flags) as base:
            args.base_url = base
            asyncio.run(run_load(args, warmup_requests(v), v.concurrency, None))
            asyncio.run(run_load(args, tenant_requests(v), v.concurrency, None))
            run = runs[policy] = asyncio.run(run_load(args, requests_for(v, quick), v.concurrency, None))
            if run["failed"]:
                errors = [e for e in run["vllm"]["errors"] if e]
                raise RuntimeError(f"{v.name}, {policy}: {run['failed']} requests failed, e.g. {errors[:1]}")
    c, r = runs["cache_aware"], runs["round_robin"]
    ratios = {
        f"ttft_{p}_ratio_round_robin_over_cache_aware": r["ttft_s"][p] / max(c["ttft_s"][p], 1e-9)
        for p in ("median", "p90", "p99")
    }
    ratios["throughput_ratio_cache_aware_over_round_robin"] = c["request_throughput"] / max(
        r["request_throughput"], 1e-9
    )
    return {"variant": asdict(v), "prefill_num_blocks": v.prefill_blocks(), "runs": runs, **ratios}


def _slim(res: dict) -> dict:
    res = json.loads(json.dumps(res))
    for run in res.get("runs", {}).values():
        run.pop("samples", None)
        run.pop("vllm", None)
    return res


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    keys = [
        ("ttft_median_ratio_round_robin_over_cache_aware", "TTFT p50"),
        ("ttft_p90_ratio_round_robin_over_cache_aware", "TTFT p90"),
        ("ttft_p99_ratio_round_robin_over_cache_aware", "TTFT p99"),
        ("throughput_ratio_cache_aware_over_round_robin", "throughput"),
    ]
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(names)), 4.5))
    width = 0.8 / len(keys)
    for i, (key, label) in enumerate(keys):
        xs = [j + (i - (len(keys) - 1) / 2) * width for j in range(len(names))]
        ax.bar(xs, [results[n][key] for n in names], width, label=label)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(names)), names, rotation=20)
    ax.set_yscale("log")
    ax.set_ylabel("cache_aware's advantage (x, >1 = better)")
    ax.set_title("cache_aware vs round_robin over HTTP (2 prefill + 1 decode)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.prefix_routing", description=__doc__)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"from {', '.join(VARIANTS)}")
    p.add_argument("--quick", action="store_true", help="fewer requests per run")
    p.add_argument("--output", default=str(RESULTS / "prefix_routing.json"))
    a = p.parse_args()
    names = a.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    out = Path(a.output)
    results: dict[str, dict] = json.loads(out.read_text()) if out.exists() else {}
    for name in names:
        results[name] = _slim(run_variant(VARIANTS[name], a.quick))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))  # kept as it goes: a long sweep may be stopped
    print("\n==== cache_aware vs round_robin, over HTTP (ratios > 1: cache_aware better) ====")
    print(f"{'variant':16s} {'p50':>6s} {'p90':>6s} {'p99':>6s} {'thrpt':>6s}")
    for name, res in results.items():
        print(
            f"{name:16s} {res['ttft_median_ratio_round_robin_over_cache_aware']:6.2f} "
            f"{res['ttft_p90_ratio_round_robin_over_cache_aware']:6.2f} "
            f"{res['ttft_p99_ratio_round_robin_over_cache_aware']:6.2f} "
            f"{res['throughput_ratio_cache_aware_over_round_robin']:6.2f}"
        )
    print(f"wrote {out}")
    plot(results, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
