"""KV cache tiers: a multi-tenant multi-turn workload with and without the host and disk tiers (issue 33).

Each of ``--tenants`` conversations starts from a system prompt of its own and adds a user turn and
the model's reply per round; every round visits all conversations in turn (closed loop, ``--concurrency``
in flight), so a conversation's prefix is reused one round later, after every other conversation ran.
Its working set (every conversation's context) is several times the engine's KV pool in the
*overflowing* run; the *fitting* run is the same conversations on a pool that holds them all. Each runs on the
same engine configuration without a host tier and with one (``kv_host_cache_gib``), in this process;
the reply tokens are greedy, so every configuration sees the same prompts and must give the same
tokens (checked and printed). With ``--disk-gib`` (default 1), two more: a host tier too small for the
working set (``--small-host-share`` of it) with a disk tier under it (``kv_disk_cache_gib``, a file in
``--disk-dir``, default a temporary directory), and, on the overflowing workload, that small host tier
alone (what the disk tier adds).

Reported per run, over the returning turns (every round after the first: a conversation's first turn
is a miss in any system, so it is the warm-up): TTFT p50/p90 (engine time from submission to the
first token, queueing included) and requests/s; then the prompt tokens served from each tier, and the
ratios tier / no tier. The first round's figures are kept in the JSON.

    python -m bench.kv_tiers [--quick] [--output bench/results/kv_tiers.json]

On this CPU machine the "device" pool is the engine's KV pool in RAM and the host tier a separate RAM
buffer, so a load is a memcpy where a GPU pays a PCIe copy; run it on a GPU host (``--device cuda``)
for that figure.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from loadgen.vllm_result import percentile

RESULTS = Path(__file__).parent / "results"


def _pct(xs: list[float], p: float) -> float:
    return percentile(xs, p)  # interpolated, as every other figure of pdserve bench's files


def run_workload(
    core, tenants: int, rounds: int, system: int, user: int, reply: int, concurrency: int
) -> dict:
    """Drive ``core`` through the conversations; TTFTs, throughput and every reply's tokens."""
    from engine import SamplingParams

    rng = random.Random(0)
    vocab = core.spec.vocab_size
    contexts = [[rng.randrange(3, vocab) for _ in range(system)] for _ in range(tenants)]
    params = SamplingParams(temperature=0, max_tokens=reply, ignore_eos=True)
    ttfts: list[list[float]] = []  # per round
    replies: dict[str, list[int]] = {}  # by request id: the order requests end in differs by tier
    t0 = time.perf_counter()
    for r in range(rounds):
        if r == 1:
            t0 = time.perf_counter()  # the returning turns' throughput
        ttfts.append([])
        queue = list(range(tenants))
        started: dict[str, tuple[int, float]] = {}
        first: set[str] = set()
        outputs: dict[str, list[int]] = {}
        while queue or started:
            while queue and len(started) < concurrency:
                c = queue.pop(0)
                contexts[c] = contexts[c] + [rng.randrange(3, vocab) for _ in range(user)]
                rid = f"r{r}-c{c}"
                core.add_request(rid, contexts[c], params)
                started[rid] = (c, time.perf_counter())
                outputs[rid] = []
            for out in core.step():
                now = time.perf_counter()
                rid = out.request_id
                outputs[rid].extend(out.new_token_ids)
                if rid not in first and out.new_token_ids:
                    first.add(rid)
                    ttfts[r].append(now - started[rid][1])
                if out.finish_reason is not None:
                    c, _ = started.pop(rid)
                    contexts[c] = contexts[c] + outputs[rid]
                    replies[rid] = outputs[rid]
        _progress(r + 1, rounds)
    elapsed = time.perf_counter() - t0
    stats = core.stats()
    returning = [t * 1000 for turn in ttfts[1:] for t in turn]
    return {
        "requests": len(replies),
        "requests_per_s": len(returning) / elapsed,
        "ttft_ms_p50": _pct(returning, 50),
        "ttft_ms_p90": _pct(returning, 90),
        "ttft_ms": returning,
        "first_turn_ttft_ms_p50": _pct([t * 1000 for t in ttfts[0]], 50),
        "prompt_tokens": stats.prompt_tokens,
        "prefix_hit_tokens": stats.prefix_cache_hits,
        "host_hit_tokens": stats.prefix_cache_hits_host,
        "host_offloaded_blocks": stats.host_offloaded_blocks,
        "disk_hit_tokens": stats.prefix_cache_hits_disk,
        "disk_written_blocks": stats.disk_written_blocks,
        "blocks_free_after": stats.num_free_blocks == stats.num_blocks,
        "replies": [replies[rid] for rid in sorted(replies)],
    }


def _progress(done: int, total: int) -> None:
    bar = "#" * (20 * done // total)
    print(f"\r    rounds [{bar:<20}] {done}/{total}", end="\n" if done == total else "", flush=True)


def compare(args) -> dict:
    from engine.config import EngineConfig
    from engine.engine_core import EngineCore

    model = args.model or str(_demo_model())
    block = 16
    results: dict = {"args": vars(args), "model": model, "workloads": {}}
    tenants = args.tenants
    context_blocks = -(-(args.system + args.rounds * (args.user + args.reply)) // block)
    working_set = tenants * context_blocks
    # The same conversations twice: on the given pool, and on one that holds them all (plus the
    # blocks of the requests in flight), where a tier cannot help and must cost nothing.
    workloads = {
        "overflowing": args.num_blocks,
        "fitting": working_set + (args.concurrency + 1) * context_blocks,
    }
    small_host = args.small_host_share * working_set * _block_bytes(model, block, args.dtype) / 2**30
    workloads = {name: pool for name, pool in workloads.items() if name in args.workloads}
    for name, pool in workloads.items():
        print(f"\n== {name}: {tenants} conversations, working set {working_set} blocks, pool {pool}")
        configs = {"no_tier": (0.0, 0.0), "host_tier": (args.host_gib, 0.0)}  # (host GiB, disk GiB)
        if args.disk_gib:
            if name == "overflowing":  # on the fitting one no tier is touched: the same as host_tier
                configs["small_host"] = (small_host, 0.0)
            configs["small_host_disk"] = (small_host, args.disk_gib)
            if name == "overflowing":  # the same, every disk block read inside the admitting step
                configs["small_host_disk_sync"] = (small_host, args.disk_gib)
        reps: dict[str, list[dict]] = {label: [] for label in configs}
        for rep in range(args.repeats):  # alternating order, so drift of the machine hits both
            for label in list(configs)[:: 1 if rep % 2 == 0 else -1]:
                print(f"  {label} ({rep + 1}/{args.repeats}) ...", flush=True)
                core = EngineCore(
                    EngineConfig(
                        model=model,
                        device=args.device,
                        **({"dtype": args.dtype} if args.dtype else {}),
                        num_blocks=pool,
                        block_size=block,
                        kv_host_cache_gib=configs[label][0],
                        kv_disk_cache_gib=configs[label][1],
                        kv_disk_cache_dir=args.disk_dir if configs[label][1] else None,
                        max_num_seqs=args.concurrency,
                    )
                )
                if label.endswith("_sync"):
                    core.prefetch = None  # no read-ahead (engine/kv_disk_prefetch.py)
                read_s = _time_disk_reads(core)
                run = run_workload(
                    core, tenants, args.rounds, args.system, args.user, args.reply, args.concurrency
                )
                run["disk_read_engine_ms"] = read_s[0] * 1e3  # on the engine's thread, in steps
                run["read_ahead_blocks"] = core.prefetch.read_ahead_blocks if core.prefetch else 0
                reps[label].append(run)
                core.close()  # the disk tier's file
                del core
        first = reps["no_tier"][0]["replies"]
        same = all(r.pop("replies") == first for runs_ in reps.values() for r in runs_)
        runs = {label: _median_run(rs) for label, rs in reps.items()}
        base, tier = runs["no_tier"], runs["host_tier"]
        results["workloads"][name] = {
            "conversations": tenants,
            "working_set_blocks": working_set,
            "pool_blocks": pool,
            "working_set_over_pool": working_set / pool,
            "runs": runs,
            "identical_outputs": same,
            "ttft_p50_ratio": base["ttft_ms_p50"] / tier["ttft_ms_p50"],
            "ttft_p90_ratio": base["ttft_ms_p90"] / tier["ttft_ms_p90"],
            "throughput_ratio": tier["requests_per_s"] / base["requests_per_s"],
            "ratios": {  # every configuration against no tier: TTFT x lower, throughput x higher
                label: {
                    "ttft_p50": base["ttft_ms_p50"] / r["ttft_ms_p50"],
                    "ttft_p90": base["ttft_ms_p90"] / r["ttft_ms_p90"],
                    "throughput": r["requests_per_s"] / base["requests_per_s"],
                }
                for label, r in runs.items()
                if label != "no_tier"
            },
            "tier_gib": configs,
        }
    return results


def _time_disk_reads(core) -> list[float]:
    """Seconds the engine's thread spends in disk-tier reads at admission (a one-item list, growing)."""
    spent = [0.0]
    blocks = core.kv.disk_blocks
    if blocks is not None:
        read = blocks.read

        def timed(*args):
            t = time.perf_counter()
            try:
                return read(*args)
            finally:
                spent[0] += time.perf_counter() - t

        blocks.read = timed
    return spent


def _block_bytes(model: str, block: int, dtype: str | None = None) -> int:
    """Bytes of one KV block of ``model`` (float32 unless ``dtype`` is a 16-bit one)."""
    config = json.loads((Path(model) / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    width = 2 if dtype in ("bfloat16", "float16") else 4
    return config["num_hidden_layers"] * 2 * block * kv_heads * head_dim * width


def _median_run(runs: list[dict]) -> dict:
    """One configuration's repeats: the median of each figure, every TTFT kept (for the plot)."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, float):
            out[key] = statistics.median(r[key] for r in runs)
    out["ttft_ms"] = [t for r in runs for t in r["ttft_ms"]]
    out["blocks_free_after"] = all(r["blocks_free_after"] for r in runs)
    out["repeats"] = len(runs)
    return out


def _demo_model() -> Path:
    from cli.tiny_model import ensure_tiny_model

    return ensure_tiny_model()


def _print(out: dict) -> None:
    print(
        "\n| workload | working set / pool | tier | TTFT p50 ms | TTFT p90 ms | req/s | hit tokens (host, disk) |"
    )
    print("|---|---:|---|---:|---:|---:|---:|")
    for name, w in out["workloads"].items():
        for label, r in w["runs"].items():
            print(
                f"| {name} | {w['working_set_over_pool']:.1f}x | {label} | {r['ttft_ms_p50']:.1f} | "
                f"{r['ttft_ms_p90']:.1f} | {r['requests_per_s']:.2f} | "
                f"{r['prefix_hit_tokens']} ({r['host_hit_tokens']}, {r['disk_hit_tokens']}) |"
            )
    for name, w in out["workloads"].items():
        for label, ratio in w["ratios"].items():
            print(
                f"{name}: {label} / none: TTFT p50 {ratio['ttft_p50']:.2f}x lower, p90 "
                f"{ratio['ttft_p90']:.2f}x lower, throughput {ratio['throughput']:.2f}x"
            )
        print(f"{name}: identical outputs: {'yes' if w['identical_outputs'] else 'NO'}")
        for label, r in w["runs"].items():
            if r.get("disk_hit_tokens") or label.endswith("disk_sync"):
                print(
                    f"{name}: {label}: {r['disk_read_engine_ms']:.1f} ms of disk reads on the engine's "
                    f"thread, {r['read_ahead_blocks']} blocks read ahead"
                )


def _plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(out["workloads"])
    fig, axes = plt.subplots(1, n, figsize=(5.5 * n, 4), squeeze=False)
    for ax, (name, w) in zip(axes[0], out["workloads"].items()):
        for label, r in w["runs"].items():
            xs = sorted(r["ttft_ms"])
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label.replace("_", " "))
        ax.set_title(f"{name}: working set {w['working_set_over_pool']:.1f}x the KV pool")
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_xscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint (default: the demo tiny Llama)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", help="the engine's dtype (default: the engine's own for the device)")
    p.add_argument("--tenants", type=int, default=24, help="conversations of the overflowing workload")
    p.add_argument("--rounds", type=int, default=4, help="turns per conversation (the first is warm-up)")
    p.add_argument("--system", type=int, default=384, help="system prompt tokens per conversation")
    p.add_argument("--user", type=int, default=32, help="user tokens per turn")
    p.add_argument("--reply", type=int, default=16, help="reply tokens per turn")
    p.add_argument("--num-blocks", type=int, default=160, help="the engine's KV pool (blocks of 16)")
    p.add_argument("--host-gib", type=float, default=0.5, help="host tier size")
    p.add_argument("--disk-gib", type=float, default=1.0, help="disk tier size (0: no disk runs)")
    p.add_argument("--disk-dir", help="the disk tier's directory (default: a temporary one)")
    p.add_argument(
        "--small-host-share", type=float, default=0.25, help="the disk runs' host tier, in working sets"
    )
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3, help="runs of each configuration (medians reported)")
    p.add_argument(
        "--workloads", nargs="+", default=["overflowing", "fitting"], choices=["overflowing", "fitting"]
    )
    p.add_argument("--quick", action="store_true", help="a smoke run (tiny sizes)")
    p.add_argument("--output", type=Path, default=RESULTS / "kv_tiers.json")
    args = p.parse_args(argv)
    if args.quick:
        args.tenants, args.rounds, args.system, args.num_blocks = 6, 2, 64, 24
        args.repeats = 1
    out = compare(args)
    _print(out)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=1, default=str))
    plot = args.output.with_suffix(".png")
    _plot(out, plot)
    print(f"wrote {args.output} and {plot}")
    ok = all(
        w["identical_outputs"] and all(r["blocks_free_after"] for r in w["runs"].values())
        for w in out["workloads"].values()
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
