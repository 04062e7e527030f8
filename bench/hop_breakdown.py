"""Where a short request's time goes, hop by hop, through the whole HTTP stack.

    python -m bench.hop_breakdown [--quick] [--http-server serve_proxy,direct,router] [--cpu-threads N]

Starts ``pdserve serve`` aggregated (1 decode worker) and disaggregated (1 prefill + 1 decode), per
HTTP server, and sends short requests (16 prompt tokens, 16 output tokens) at concurrency 1 and 32
with ``x-pdserve-debug: timing``: every request comes back with each hop's own durations (ingress,
router, prefill queue and compute, KV transfer, first decode step, ...), and the HTTP proxy's share
is the client's TTFT less the ingress's (with ``router`` the ingress runs inside the router replica
and ``grpc_ingress_router`` is ~0). Per request, the TTFT splits exactly into:

    http_proxy + ingress_parse + ingress_queue + ingress + grpc_ingress_router + route + router
      + grpc_router_worker + worker queue + worker compute (the step that made the first token)

(the worker is the prefill worker when disaggregated, the decode worker when aggregated). Prints
median / p90 of each, and the engine alone's TTFT at concurrency 1 (``LLM.generate``, max_tokens=1,
the same prompts, one at a time) with the difference. Writes bench/results/hop_breakdown.json and a
stacked-bar PNG next to it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.serving_harness import VOCAB, bench_args, load, serving
from loadgen.serving_datasets import build

RESULTS = Path(__file__).parent / "results"
MODES = {
    "aggregated": ("--mode", "aggregated", "--decode", "1"),
    "disaggregated": ("--prefill", "1", "--decode", "1"),
}
# The TTFT path, in order; each a function of one request's timing (ms).
TTFT_PATH = (
    "http_proxy",
    "ingress_parse",
    "ingress_queue",
    "ingress",
    "grpc_ingress_router",
    "route",
    "router",
    "grpc_router_worker",
    "worker_queue",
    "worker_compute",
)
AFTER_FIRST_TOKEN = ("decode_call", "kv_transfer", "decode_queue", "decode_first_step")


def ttft_path(t: dict[str, float]) -> dict[str, float] | None:
    """One request's TTFT split along its path (ms); None when its timing is incomplete."""
    disagg = "prefill_call" in t
    call = t.get("prefill_call" if disagg else "decode_call")
    need = ("ttft", "client_ttft", "router_call", "router", "ingress")
    if call is None or any(k not in t for k in need):
        return None
    queue = t.get("prefill_queue" if disagg else "decode_queue", 0.0)
    compute = t.get("prefill_compute" if disagg else "decode_first_step", 0.0)
    return {
        "http_proxy": max(0.0, t["client_ttft"] - t["ttft"]),
        "ingress_parse": t["ingress_parse"],
        "ingress_queue": t["ingress_queue"],
        "ingress": t["ingress"],
        "grpc_ingress_router": max(0.0, t["router_call"] - t["router"] - call),
        "route": t.get("route", 0.0),
        "router": max(0.0, t["router"] - t.get("route", 0.0)),
        "grpc_router_worker": max(0.0, call - queue - compute),
        "worker_queue": queue,
        "worker_compute": compute,
    }


def _stats(values: list[float]) -> dict[str, float]:
    s = sorted(values)
    if not s:
        return {"median": 0.0, "p90": 0.0, "mean": 0.0}
    return {
        "median": s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2,
        "p90": s[min(len(s) - 1, round(0.9 * (len(s) - 1)))],
        "mean": statistics.fmean(s),
    }


def breakdown(run: dict) -> dict:
    timings = run["samples"]["timing_ms"]
    paths = [p for p in (ttft_path(t) for t in timings) if p is not None]
    out = {"requests": len(timings), "complete": len(paths)}
    out["ttft_path_ms"] = {hop: _stats([p[hop] for p in paths]) for hop in TTFT_PATH}
    # Disaggregated: the decode worker's part comes after the first token (aggregated, it is the
    # worker part of the TTFT path above).
    disagg = [t for t in timings if "prefill_call" in t]
    out["after_first_token_ms"] = {
        hop: _stats([t[hop] for t in disagg if hop in t])
        for hop in AFTER_FIRST_TOKEN
        if any(hop in t for t in disagg)
    }
    out["client_ttft_ms"] = _stats([t["client_ttft"] for t in timings])
    out["ingress_ttft_ms"] = _stats([t["ttft"] for t in timings if "ttft" in t])
    out["request_throughput"] = run["request_throughput"]
    return out


def engine_ttft(prompts: list[list[int]]) -> dict[str, float]:
    """The engine alone: one request at a time, max_tokens=1 (its time to the first token)."""
    from cli.tiny_model import ensure_tiny_model
    from engine import LLM, SamplingParams

    llm = LLM(str(ensure_tiny_model()), num_blocks=2048)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for p in prompts[:4]:
        llm.generate([p], params, use_tqdm=False)
    times = []
    for p in prompts:
        t0 = time.perf_counter()
        llm.generate([p], params, use_tqdm=False)
        times.append((time.perf_counter() - t0) * 1e3)
    del llm
    return _stats(times)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.hop_breakdown", description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    p.add_argument(
        "--http-server", default="serve_proxy,direct", help="comma-separated: serve_proxy, direct, router"
    )
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="the workers' torch threads (default: pdserve serve's, this machine's cores / workers)",
    )
    p.add_argument("--output", default=str(RESULTS / "hop_breakdown.json"))
    a = p.parse_args()
    threads = ("--cpu-threads", str(a.cpu_threads)) if a.cpu_threads else ()
    common = dict(
        dataset="random", input_len=16, output_len=16, vocab_size=VOCAB, ignore_eos=True, debug_timing=True
    )
    levels = {1: bench_args(num_prompts=16 if a.quick else 48, warmup=4, **common)}
    levels[32] = bench_args(num_prompts=64 if a.quick else 192, warmup=8, **common)
    engine = engine_ttft([r.prompt for r in build(levels[1])])
    print(
        f"engine alone, TTFT at concurrency 1: median {engine['median']:.2f} ms, p90 {engine['p90']:.2f} ms"
    )
    out: dict = {"engine_alone_ttft_ms": engine, "runs": {}}
    for server in a.http_server.split(","):
        for mode, flags in MODES.items():
            with serving(*flags, "--http-server", server, *threads) as base:
                for c, args in levels.items():
                    run = breakdown(load(base, args, concurrency=c))
                    run["ttft_over_engine_ms"] = run["client_ttft_ms"]["median"] - engine["median"]
                    out["runs"][f"{mode}/{server}/c{c}"] = run
                    _print(f"{mode}, {server}, concurrency {c}", run)
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.output}")
    _plot(out, Path(a.output).with_suffix(".png"))


def _print(title: str, run: dict) -> None:
    print(f"\n== {title}: {run['complete']}/{run['requests']} requests with complete timing")
    print(f"   {'hop':22s} {'median ms':>10s} {'p90 ms':>10s}")
    for hop, st in run["ttft_path_ms"].items():
        print(f"   {hop:22s} {st['median']:10.2f} {st['p90']:10.2f}")
    c, i = run["client_ttft_ms"], run["ingress_ttft_ms"]
    print(
        f"   {'= client TTFT':22s} {c['median']:10.2f} {c['p90']:10.2f}   (ingress's TTFT {i['median']:.2f})"
    )
    print(f"   TTFT over the engine alone's (median): {run['ttft_over_engine_ms']:+.2f} ms")
    for hop, st in run["after_first_token_ms"].items():
        print(f"   after the first token: {hop:18s} {st['median']:10.2f} {st['p90']:10.2f}")
    print(f"   requests/s {run['request_throughput']:.2f}")


def _plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = out["runs"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, level in zip(axes, ("c1", "c32")):
        names = [n for n in runs if n.endswith(level)]
        bottoms = [0.0] * len(names)
        for hop in TTFT_PATH:
            heights = [runs[n]["ttft_path_ms"][hop]["median"] for n in names]
            ax.bar(range(len(names)), heights, bottom=bottoms, label=hop)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
        if level == "c1":
            ax.axhline(out["engine_alone_ttft_ms"]["median"], color="k", ls="--", label="engine alone")
        ax.set_xticks(range(len(names)), [n.rsplit("/", 1)[0].replace("/", "\n") for n in names], fontsize=8)
        ax.set_ylabel("ms (median of each hop)")
        ax.set_title(f"TTFT by hop, 16 in / 16 out, concurrency {level[1:]}")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
