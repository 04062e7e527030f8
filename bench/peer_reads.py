"""Prefix blocks read across workers (issue 33 item 3) vs computed, over HTTP, same requests.

The full stack (``pdserve serve``: 2 prefill + 1 decode workers, embedded Redis; ``--mode
aggregated``: 2 decode workers that compute their prompts, no prefill workers) on the hot-tenant
prefix workload: ``T`` tenants drawn from a Zipf distribution (``--skew``), each request a tenant's
``P``-token system prompt plus a unique question, ``C`` clients back to back. The hot tenants' owner
gets a queue, and ``cache_aware`` spills them onto the other prefill worker, which then computes the
prefix again (no peer reads) or reads it from the owner's tiers over NIXL (peer reads). Aggregated,
the router picks the decode worker by load, so a tenant's request lands where its prefix is not half
of the time; the worker then computes it or reads it from the other. Three runs:

- ``no tier``: no host tier (nothing to read from a peer's host tier; device-held prefixes are
  recomputed on spill),
- ``host tier``: ``kv_host_cache_gib`` on the workers that compute prompts, ``--no-peer-reads``,
- ``host tier + peer reads``: the same with peer reads (the default).

Each computing worker's pool holds about half the tenants' prompts (the working set overflows one worker's
pool). Reported: TTFT p50/p90 and requests/s at the HTTP client, the blocks read from peers
(``pdserve_kv_peer_blocks_total``), and the ratios to ``host tier``.

    python -m bench.peer_reads [--quick] [--mode aggregated]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import urllib.request
from pathlib import Path

from bench.prefix_routing import (
    BLOCK,
    OUTPUT,
    SUFFIX,
    Variant,
    requests_for,
    tenant_requests,
    warmup_requests,
)
from bench.serving_harness import VOCAB, bench_args, serving
from loadgen.serving_client import run_load

RESULTS = Path(__file__).parent / "results"
CONFIGS = ("no tier", "host tier", "host tier + peer reads")


def _peer_blocks(base: str) -> dict[str, float]:
    """The cluster's ``pdserve_kv_peer_blocks_total`` by direction."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "pdserve_kv_peer_blocks_total":
                out[s.labels["direction"]] = out.get(s.labels["direction"], 0.0) + s.value
    return out


def run(v: Variant, quick: bool, host_gib: float, mode: str = "disaggregated") -> dict:
    args = bench_args(warmup=0, ignore_eos=True, vocab_size=VOCAB, no_progress=False)
    runs = {}
    for config in CONFIGS:
        engine = {"num_blocks": v.prefill_blocks()}
        if config != "no tier":
            engine["kv_host_cache_gib"] = host_gib
        if mode == "aggregated":
            flags = ["--mode", "aggregated", "--decode", "2", "--worker-cpus", "0.5"]
            flags += ["--decode-engine", json.dumps(engine)]
        else:
            flags = ["--prefill", "2", "--decode", "1", "--worker-cpus", "0.5"]
            flags += ["--prefill-engine", json.dumps(engine)]
        if config == "host tier":
            flags.append("--no-peer-reads")
        print(f"\n[{config}] pdserve serve {' '.join(flags)}", flush=True)
        with serving(*flags) as base:
            args.base_url = base
            asyncio.run(run_load(args, warmup_requests(v), v.concurrency, None))
            asyncio.run(run_load(args, tenant_requests(v), v.concurrency, None))
            before = _peer_blocks(base)
            res = asyncio.run(run_load(args, requests_for(v, quick), v.concurrency, None))
            after = _peer_blocks(base)
            if res["failed"]:
                raise RuntimeError(f"{config}: {res['failed']} requests failed")
            res["peer_blocks"] = {
                k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("received", "lent", "rejected")
            }
            res.pop("samples", None)
            res.pop("vllm", None)
            runs[config] = res
    base = runs["host tier"]
    ratios = {
        config: {
            "ttft_p50_x_lower": base["ttft_s"]["median"] / max(r["ttft_s"]["median"], 1e-9),
            "ttft_p90_x_lower": base["ttft_s"]["p90"] / max(r["ttft_s"]["p90"], 1e-9),
            "throughput_x": r["request_throughput"] / max(base["request_throughput"], 1e-9),
        }
        for config, r in runs.items()
    }
    return {
        "mode": mode,
        "variant": v.__dict__,
        "block_size": BLOCK,
        "suffix": SUFFIX,
        "output": OUTPUT,
        "runs": runs,
        "vs_host_tier": ratios,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = list(runs)
    for ax, (key, label) in zip(axes, (("ttft", "TTFT (ms)"), ("thr", "requests/s"))):
        if key == "ttft":
            for i, p in enumerate(("median", "p90")):
                xs = [j + (i - 0.5) * 0.4 for j in range(len(names))]
                ax.bar(xs, [runs[n]["ttft_s"][p] * 1e3 for n in names], 0.4, label=p)
            ax.legend()
        else:
            ax.bar(range(len(names)), [runs[n]["request_throughput"] for n in names], 0.6)
        ax.set_xticks(range(len(names)), names, rotation=10)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    where = "2 decode workers, aggregated" if result.get("mode") == "aggregated" else "2 prefill workers"
    fig.suptitle(f"hot tenants on {where}: prefix read from the owner vs computed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.peer_reads", description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer requests")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--skew", type=float, default=1.2, help="Zipf exponent of the tenants' popularity")
    p.add_argument("--host-gib", type=float, default=0.25, help="each computing worker's host tier")
    p.add_argument(
        "--mode",
        default="disaggregated",
        choices=("disaggregated", "aggregated"),
        help="peer reads between 2 prefill workers (1 decode), or between 2 aggregated decode workers",
    )
    p.add_argument(
        "--output", help="default: results/peer_reads.json (aggregated: peer_reads_aggregated.json)"
    )
    a = p.parse_args()
    v = Variant(
        "peer_reads", tenants=a.tenants, prefix_len=a.prefix_len, concurrency=a.concurrency, skew=a.skew
    )
    result = run(v, a.quick, a.host_gib, a.mode)
    name = "peer_reads.json" if a.mode == "disaggregated" else "peer_reads_aggregated.json"
    out = Path(a.output or RESULTS / name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print("\n==== peer reads vs computing the prefix (ratios vs 'host tier', >1 better) ====")
    print(
        f"{'config':24s} {'p50 ms':>8s} {'p90 ms':>8s} {'req/s':>7s} {'p50 x':>6s} {'p90 x':>6s} {'thr x':>6s} {'read':>6s}"
    )
    for name, r in result["runs"].items():
        x = result["vs_host_tier"][name]
        print(
            f"{name:24s} {r['ttft_s']['median'] * 1e3:8.1f} {r['ttft_s']['p90'] * 1e3:8.1f} "
            f"{r['request_throughput']:7.2f} {x['ttft_p50_x_lower']:6.2f} {x['ttft_p90_x_lower']:6.2f} "
            f"{x['throughput_x']:6.2f} {r['peer_blocks']['received']:6.0f}"
        )
    print(f"wrote {out}")
    plot(result, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
