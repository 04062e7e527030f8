"""KV cache tiers served (issue 33 item 5): the multi-tenant multi-turn workload over HTTP through
``pdserve serve --mode aggregated --decode 2`` with no tier, a host tier, and a host tier whose
workers read a peer's blocks, same requests.

Each of ``--tenants`` conversations starts from a system prompt of its own; every round adds the
last reply and a user turn to each conversation and sends all of them (closed loop, ``--concurrency``
clients), so a conversation comes back one round later, after every other one ran. The reply in the
history is a stand-in drawn with the conversation (the same tokens in every configuration), since a
streamed completion's text does not give back its token ids. The router picks the decode worker by
load, so a returning conversation lands on the worker that served its last turn about half the time:

- ``no tier``: a context evicted from the worker's KV pool, or held only by the other worker, is
  computed again;
- ``host tier``: ``kv_host_cache_gib`` on both workers, ``--no-peer-reads``: evicted contexts come
  back from the worker's own host tier; one the other worker holds is computed;
- ``host tier + peer reads``: the same, and a context the other worker holds (on its device or in
  its host tier) is read from there over NIXL (``worker/peer_reads.py``).

*Overflowing*: each worker's KV pool (``--num-blocks``) holds a fraction of the working set (every
conversation's final context); *fitting*: a pool that holds it all. Reported per run over the
returning turns (every round after the first): TTFT p50/p90 at the HTTP client, requests/s, the
prompt tokens served from each tier and the blocks read from peers (``/metrics``), and the ratios to
``no tier``.

    python -m bench.kv_tiers_served [--quick] [--workloads overflowing,fitting]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import urllib.request
from pathlib import Path

from bench.serving_harness import VOCAB, bench_args, serving
from loadgen.serving_client import run_load
from loadgen.serving_datasets import ServingRequest

RESULTS = Path(__file__).parent / "results"
CONFIGS = ("no tier", "host tier", "host tier + peer reads")
BLOCK = 16  # the engine's default block size


def conversations(
    tenants: int, rounds: int, system: int, user: int, reply: int
) -> list[list[ServingRequest]]:
    """Each round's requests, one per conversation in order."""
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(10, VOCAB) for _ in range(n)]  # noqa: E731
    contexts = [ids(system) for _ in range(tenants)]
    out = []
    for r in range(rounds):
        for c in range(tenants):
            contexts[c] = contexts[c] + (ids(reply) if r else []) + ids(user)
        out.append([ServingRequest(list(ctx), reply, tenant=c) for c, ctx in enumerate(contexts)])
    return out


def _metrics(base: str) -> dict[str, float]:
    """Prompt tokens served by tier and blocks received from peers, cluster-wide, as ``/metrics`` has them."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "pdserve_prefix_cache_tier_hits_total":
                key = f"hit_tokens_{s.labels['tier']}"
            elif s.name == "pdserve_kv_peer_blocks_total" and s.labels["direction"] == "received":
                key = "peer_blocks_received"
            else:
                continue
            out[key] = out.get(key, 0.0) + s.value
    return out


def run_config(
    config: str, rounds: list[list[ServingRequest]], num_blocks: int, host_gib: float, concurrency: int
) -> dict:
    engine: dict = {"num_blocks": num_blocks}
    if config != "no tier":
        engine["kv_host_cache_gib"] = host_gib
    flags = [
        "--mode",
        "aggregated",
        "--decode",
        "2",
        "--worker-cpus",
        "0.5",
        "--decode-engine",
        json.dumps(engine),
    ]
    if config == "host tier":
        flags.append("--no-peer-reads")
    args = bench_args(warmup=0, ignore_eos=True, vocab_size=VOCAB, no_progress=False, temperature=0.0)
    with serving(*flags) as base:
        args.base_url = base
        per_round, before = [], None
        for r, reqs in enumerate(rounds):
            if r == 1:
                before = _metrics(base)
            res = asyncio.run(run_load(args, reqs, concurrency, None))
            if res["failed"]:
                raise RuntimeError(f"{config}: {res['failed']} requests failed: {res['errors']}")
            per_round.append(res)
        after = _metrics(base)
    returning = per_round[1:]
    ttfts = [t for res in returning for t in res["samples"]["ttft_s"]]
    return {
        "ttft_p50_ms": statistics.median(ttfts) * 1e3,
        "ttft_p90_ms": sorted(ttfts)[round(0.9 * (len(ttfts) - 1))] * 1e3,
        "requests_per_s": sum(res["completed"] for res in returning)
        / sum(res["duration_s"] for res in returning),
        "first_round_ttft_p50_ms": per_round[0]["ttft_s"]["median"] * 1e3,
        "returning": {k: after.get(k, 0.0) - (before or {}).get(k, 0.0) for k in after},
        "ttft_s": ttfts,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = result["workloads"]
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
    for ax, (name, w) in zip(axes[0], workloads.items()):
        for config, r in w["runs"].items():
            xs = sorted(t * 1e3 for t in r["ttft_s"])
            ax.plot(
                xs,
                [(i + 1) / len(xs) for i in range(len(xs))],
                label=f"{config} ({r['requests_per_s']:.2f} req/s)",
            )
        ax.set_xscale("log")
        ax.set_xlabel("TTFT of returning turns (ms, HTTP client)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{name}: pool {w['num_blocks']} blocks/worker, working set {w['working_set_blocks']}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("multi-turn conversations on 2 aggregated decode workers: KV tiers and peer reads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.kv_tiers_served", description=__doc__)
    p.add_argument("--quick", action="store_true", help="8 conversations, 3 rounds")
    p.add_argument("--tenants", type=int, default=24)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--system", type=int, default=384, help="tokens of a conversation's system prompt")
    p.add_argument("--user", type=int, default=32, help="tokens of a user turn")
    p.add_argument("--reply", type=int, default=16, help="tokens of a reply")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-blocks", type=int, default=160, help="each worker's KV pool, overflowing run")
    p.add_argument("--host-gib", type=float, default=0.5)
    p.add_argument("--workloads", default="overflowing,fitting")
    p.add_argument("--output", default=str(RESULTS / "kv_tiers_served.json"))
    a = p.parse_args()
    if a.quick:
        a.tenants, a.rounds = 8, 3
    rounds = conversations(a.tenants, a.rounds, a.system, a.user, a.reply)
    working_set = sum(-(-(len(r.prompt) + a.reply) // BLOCK) for r in rounds[-1])
    result = {"args": vars(a), "workloads": {}}
    for workload in a.workloads.split(","):
        blocks = a.num_blocks if workload == "overflowing" else working_set + 64
        runs = {}
        for config in CONFIGS:
            print(f"\n[{workload}, {config}] {a.tenants} conversations x {a.rounds} rounds", flush=True)
            runs[config] = run_config(config, rounds, blocks, a.host_gib, a.concurrency)
        base = runs["no tier"]
        ratios = {
            c: {
                "ttft_p50_x_lower": base["ttft_p50_ms"] / r["ttft_p50_ms"],
                "ttft_p90_x_lower": base["ttft_p90_ms"] / r["ttft_p90_ms"],
                "throughput_x": r["requests_per_s"] / base["requests_per_s"],
            }
            for c, r in runs.items()
        }
        result["workloads"][workload] = {
            "num_blocks": blocks,
            "working_set_blocks": working_set,
            "runs": runs,
            "vs_no_tier": ratios,
        }
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print("\n==== returning turns, ratios vs 'no tier' (>1 better) ====")
    print(
        f"{'workload':12s} {'config':24s} {'p50 ms':>8s} {'p90 ms':>8s} {'req/s':>6s} {'p50 x':>6s} {'p90 x':>6s} {'thr x':>6s} {'host tok':>9s} {'peer blk':>9s}"
    )
    for workload, w in result["workloads"].items():
        for config, r in w["runs"].items():
            x, n = w["vs_no_tier"][config], r["returning"]
            print(
                f"{workload:12s} {config:24s} {r['ttft_p50_ms']:8.1f} {r['ttft_p90_ms']:8.1f} {r['requests_per_s']:6.2f} "
                f"{x['ttft_p50_x_lower']:6.2f} {x['ttft_p90_x_lower']:6.2f} {x['throughput_x']:6.2f} "
                f"{n.get('hit_tokens_host', 0):9.0f} {n.get('peer_blocks_received', 0):9.0f}"
            )
    print(f"wrote {out}")
    plot(result, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
