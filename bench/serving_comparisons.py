"""The serving comparisons, each a ratio from one run on this machine (``pdserve bench`` as client):

1. disaggregated vs aggregated at equal total workers (1 prefill + 1 decode vs 2 aggregated decode
   workers) under an interference mix (long prompts among short chat turns): ITL p99 and goodput,
   with today's engine policy and with conditional disaggregation + fair batching;
2. conditional disaggregation: short chat turns prefilled on the decode worker vs always
   disaggregating (TTFT of the short turns, ITL p99);
3. cache_aware vs round_robin routing on the multi-tenant prefix workload (the headline variant of
   ``python -m bench.prefix_routing``, which sweeps the others): TTFT p50/p90/p99 and throughput;
4. serving overhead: request throughput of the full HTTP stack (ingress -> router -> worker) vs the
   engine alone on the same short requests, both offline (``LLM.generate`` with every request queued
   at once) and closed-loop at the HTTP client's concurrency (at most 32 requests in the engine),
   and vs the thinnest server a Python stack can be (``bench.minimal_server``: the engine loop and a
   bare SSE endpoint in one process), the ceiling of any HTTP front on the same cores;
5. ``pdserve serve`` with no layout flags (and aggregated) vs the engine alone, same load (``default_flags``).
(The engine vs HF transformers comparison is ``python -m bench.offline_throughput``.)

    python -m bench.serving_comparisons [--only interference,local_prefill,prefix,overhead,default_flags] [--quick]

Each server is ``pdserve serve`` on the default tiny random Llama (~32M parameters, fp32) with an
embedded Redis, started and stopped by this script. Results: bench/results/serving_comparisons.json
and PNG plots next to it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.minimal_server import minimal_serving
from bench.serving_harness import VOCAB, bench_args, load, serving
from loadgen.serving_datasets import build
from loadgen.vllm_result import percentile

RESULTS = Path(__file__).parent / "results"


def interference_args(quick: bool) -> argparse.Namespace:
    """Long prompts (25%, 768 tokens) among 32-token chat turns, 48 output tokens each."""
    return bench_args(
        dataset="interference",
        num_prompts=24 if quick else 64,
        long_len=768,
        input_len=32,
        output_len=48,
        long_fraction=0.25,
        vocab_size=VOCAB,
        ignore_eos=True,
        warmup=2,
        goodput={"ttft": 4000.0, "tpot": 150.0},
    )


def interference(quick: bool) -> dict:
    """Equal workers (1 prefill + 1 decode vs 2 aggregated), today's engine policy and the full
    package on each side: disaggregation with short turns prefilled on the decode worker
    (``--local-prefill-tokens 64``) and fair prefill/decode batching, against aggregated serving
    with fifo and with fair batching."""
    args = interference_args(quick)
    disagg = ("--prefill", "1", "--decode", "1")
    agg = ("--mode", "aggregated", "--decode", "2")
    fair = ("--scheduling-policy", "fair", "--itl-target-ms", "200")  # ~5 decode steps here
    runs = {}
    for name, flags in (
        ("disaggregated", disagg),
        ("disaggregated_local_prefill_fair", (*disagg, "--local-prefill-tokens", "64", *fair)),
        ("aggregated", agg),
        ("aggregated_fair", (*agg, *fair)),
    ):
        with serving(*flags) as base:
            runs[name] = load(base, args, concurrency=8)
    d, a = runs["disaggregated"], runs["aggregated"]
    best_d = runs["disaggregated_local_prefill_fair"]
    best_a = max(a, runs["aggregated_fair"], key=lambda r: r["goodput"])

    def ratio(x: float, y: float) -> float:
        return x / y if y else float("inf")

    return {
        "runs": runs,
        "itl_p99_ratio_aggregated_over_disaggregated": a["itl_s"]["p99"] / d["itl_s"]["p99"],
        "goodput_ratio_disaggregated_over_aggregated": ratio(d["goodput"], a["goodput"]),
        "itl_p99_ratio_best_aggregated_over_best_disaggregated": best_a["itl_s"]["p99"]
        / best_d["itl_s"]["p99"],
        "goodput_ratio_best_disaggregated_over_best_aggregated": ratio(best_d["goodput"], best_a["goodput"]),
    }


def _split_by_length(run: dict, short_max: int) -> dict:
    """TTFT (ms) of the short and the long requests of a run, from its per-request lists."""
    v = run["vllm"]
    ok = [(n, t) for n, t, e in zip(v["input_lens"], v["ttfts"], v["errors"]) if not e]
    short = sorted(t * 1000 for n, t in ok if n <= short_max)
    long_ = sorted(t * 1000 for n, t in ok if n > short_max)

    pct = percentile  # interpolated, as the vLLM-format fields beside these

    return {
        "short_ttft_ms_median": pct(short, 50),
        "short_ttft_ms_p90": pct(short, 90),
        "long_ttft_ms_median": pct(long_, 50),
    }


def local_prefill(quick: bool) -> dict:
    """Conditional disaggregation (1 prefill + 1 decode, interference mix): short chat turns
    prefilled on the decode worker (``--local-prefill-tokens 64``) against always disaggregating.
    Short turns should get their first token sooner (no prefill hop, no KV transfer), while long
    prompts still go to the prefill worker, so the decode batch keeps its ITL protection."""
    args = interference_args(quick)
    runs, split = {}, {}
    for name, threshold in (("always_disaggregated", "0"), ("local_prefill_64", "64")):
        with serving("--prefill", "1", "--decode", "1", "--local-prefill-tokens", threshold) as base:
            runs[name] = load(base, args, concurrency=8)
        split[name] = _split_by_length(runs[name], short_max=64)
    a, lp = runs["always_disaggregated"], runs["local_prefill_64"]
    return {
        "runs": runs,
        "by_length": split,
        "short_ttft_median_ratio_always_over_local": split["always_disaggregated"]["short_ttft_ms_median"]
        / max(split["local_prefill_64"]["short_ttft_ms_median"], 1e-9),
        "itl_p99_ratio_local_over_always": lp["itl_s"]["p99"] / a["itl_s"]["p99"],
        "goodput_ratio_local_over_always": lp["goodput"] / a["goodput"] if a["goodput"] else float("inf"),
    }


def prefix(quick: bool) -> dict:
    from bench.prefix_routing import VARIANTS, run_variant

    return run_variant(VARIANTS["headline"], quick)


def short_requests(num_prompts: int) -> argparse.Namespace:
    """The short-request workload of ``overhead`` and ``default_flags``: 16 tokens in, 16 out."""
    return bench_args(
        dataset="random",
        num_prompts=num_prompts,
        input_len=16,
        output_len=16,
        vocab_size=VOCAB,
        ignore_eos=True,
        warmup=4,
    )


def overhead(quick: bool, device: str = "cpu", dtype: str = "float32") -> dict:
    """On a GPU host: ``--device cuda --dtype bfloat16``, each worker given its share of the GPU."""
    import torch

    from cli.tiny_model import ensure_tiny_model
    from engine import LLM, SamplingParams

    args = short_requests(64 if quick else 192)
    requests = build(args)
    llm = LLM(str(ensure_tiny_model()), num_blocks=2048, device=device, dtype=dtype)
    prompts = [r.prompt for r in requests]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm.generate(prompts[:4], params)
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    engine_rps = len(prompts) / (time.perf_counter() - t0)
    engine_closed_rps = engine_closed_loop(llm.core, prompts, params, concurrency=32)
    # The engine alone with one torch thread, the other core left to nothing: as each worker of a
    # 1 P + 1 D pair runs it here. Apart, this isolates the serving path's own overhead from the
    # second core the engine-alone baseline gets.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine_one_thread_rps = engine_closed_loop(llm.core, prompts, params, concurrency=32)
    torch.set_num_threads(threads)
    del llm
    runs = {}
    # `pdserve serve` shares this machine's cores out among its CPU workers (an aggregated worker
    # gets both cores' torch threads, a 1 P + 1 D pair one each); the other thread count is run too.
    for name, flags in (
        ("aggregated_http", ("--mode", "aggregated", "--decode", "1", "--http-server", "serve_proxy")),
        ("aggregated_http_direct", ("--mode", "aggregated", "--decode", "1", "--http-server", "direct")),
        ("disaggregated_http", ("--prefill", "1", "--decode", "1", "--http-server", "serve_proxy")),
        ("disaggregated_http_direct", ("--prefill", "1", "--decode", "1", "--http-server", "direct")),
        ("aggregated_http_router", ("--mode", "aggregated", "--decode", "1", "--http-server", "router")),
        ("disaggregated_http_router", ("--prefill", "1", "--decode", "1", "--http-server", "router")),
        # Eight tokens per message instead of one (the first and last at once): what per-token messages
        # cost the engine that shares the cores with them.
        (
            "aggregated_http_router_stream_interval_8",
            ("--mode", "aggregated", "--decode", "1", "--http-server", "router", "--stream-interval", "8"),
        ),
        (
            "disaggregated_http_router_stream_interval_8",
            ("--prefill", "1", "--decode", "1", "--http-server", "router", "--stream-interval", "8"),
        ),
        # Conditional disaggregation: these 16-token prompts are prefilled on the decode worker.
        (
            "disaggregated_http_router_local_prefill_64",
            ("--prefill", "1", "--decode", "1", "--http-server", "router", "--local-prefill-tokens", "64"),
        ),
    ):
        if device != "cpu":  # each worker of the pair gets half the GPU
            gpus = "0.5" if "--prefill" in flags else "1"
            flags = (*flags, "--device", device, "--dtype", dtype, "--worker-gpus", gpus)
        with serving(*flags) as base:
            runs[name] = load(base, args, concurrency=32)
    # The ceiling of any Python HTTP front on these cores: the engine loop and a bare SSE endpoint in
    # one process, nothing else (bench/minimal_server.py).
    with minimal_serving(str(ensure_tiny_model()), device, dtype) as base:
        runs["minimal_one_process"] = load(base, args, concurrency=32)
    closed = {
        f"{name}_over_engine_closed_loop": run["request_throughput"] / engine_closed_rps
        for name, run in runs.items()
    }
    closed.update(
        {
            f"{name}_over_engine_one_thread": run["request_throughput"] / engine_one_thread_rps
            for name, run in runs.items()
        }
    )
    floor = runs["minimal_one_process"]["request_throughput"]
    closed.update(
        {f"{name}_over_minimal_one_process": run["request_throughput"] / floor for name, run in runs.items()}
    )
    for name, run in runs.items():
        print(
            f"{name}: {run['request_throughput']:.1f} req/s = {closed[f'{name}_over_engine_closed_loop']:.2f}x the "
            f"engine alone at 32 in flight ({engine_closed_rps:.1f}), "
            f"{closed[f'{name}_over_engine_one_thread']:.2f}x with one torch thread ({engine_one_thread_rps:.1f}), "
            f"{closed[f'{name}_over_minimal_one_process']:.2f}x the minimal one-process server ({floor:.1f})",
            flush=True,
        )
    return {
        "engine_alone_requests_per_s": engine_rps,
        "engine_alone_closed_loop_requests_per_s": engine_closed_rps,
        "engine_alone_closed_loop_one_thread_requests_per_s": engine_one_thread_rps,
        **closed,
        "runs": runs,
        "http_over_engine_aggregated": runs["aggregated_http"]["request_throughput"] / engine_rps,
        "http_over_engine_disaggregated": runs["disaggregated_http"]["request_throughput"] / engine_rps,
        "direct_http_over_engine_aggregated": runs["aggregated_http_direct"]["request_throughput"]
        / engine_rps,
        "direct_http_over_engine_disaggregated": runs["disaggregated_http_direct"]["request_throughput"]
        / engine_rps,
        "router_http_over_engine_aggregated": runs["aggregated_http_router"]["request_throughput"]
        / engine_rps,
        "router_http_over_engine_disaggregated": runs["disaggregated_http_router"]["request_throughput"]
        / engine_rps,
    }


def default_flags(quick: bool) -> dict:
    """``pdserve serve`` as a user starts it (no layout flags: 1 prefill + 1 decode, the router serving
    HTTP) and its aggregated form, against the engine alone closed loop at the same 32 in flight, on
    the short-request workload of ``overhead``."""
    from cli.tiny_model import ensure_tiny_model
    from engine import LLM, SamplingParams

    args = short_requests(96 if quick else 192)
    prompts = [r.prompt for r in build(args)]
    llm = LLM(str(ensure_tiny_model()), num_blocks=2048)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm.generate(prompts[:4], params)
    engine_rps = engine_closed_loop(llm.core, prompts, params, concurrency=32)
    del llm
    out: dict = {"engine_alone_closed_loop_requests_per_s": engine_rps, "runs": {}}
    for name, flags in (("default", ()), ("default_aggregated", ("--mode", "aggregated"))):
        with serving(*flags) as base:
            run = out["runs"][name] = load(base, args, concurrency=32)
        out[f"{name}_over_engine_closed_loop"] = ratio = run["request_throughput"] / engine_rps
        print(
            f"{name}: {run['request_throughput']:.1f} req/s = {ratio:.2f}x the engine alone ({engine_rps:.1f})"
        )
    return out


def engine_closed_loop(core, prompts: list, params, *, concurrency: int) -> float:
    """Requests/s of the engine alone fed like the HTTP client feeds the stack: at most
    ``concurrency`` requests in flight, the next one added as soon as one finishes."""
    pending = iter(enumerate(prompts))

    def add_next() -> None:
        nxt = next(pending, None)
        if nxt is not None:
            core.add_request(f"closed-{nxt[0]}", nxt[1], params)

    for _ in range(concurrency):
        add_next()
    t0 = time.perf_counter()
    while core.has_unfinished():
        for out in core.step():
            if out.finished:
                add_next()
    return len(prompts) / (time.perf_counter() - t0)


def engine_staggered_loop(core, prompts: list, params, *, concurrency: int) -> float:
    """Requests/s of the engine alone with its arrivals spread over the steps, as a served engine
    gets them: the first ``concurrency`` requests join one per step, then each finished request is
    replaced at once, as in ``engine_closed_loop``. Requests then end and join a few at every step
    rather than in cohorts: the batch stays full, but almost every step carries a prompt (mixed,
    and on a GPU eager rather than from a decode graph) and no decode batch stays steady."""
    pending = iter(enumerate(prompts))

    def add_next() -> None:
        nxt = next(pending, None)
        if nxt is not None:
            core.add_request(f"staggered-{nxt[0]}", nxt[1], params)

    t0 = time.perf_counter()
    for _ in range(concurrency):  # the ramp: one joins per step
        add_next()
        for out in core.step():
            if out.finished:
                add_next()
    while core.has_unfinished():
        for out in core.step():
            if out.finished:
                add_next()
    return len(prompts) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.serving_comparisons", description=__doc__)
    p.add_argument("--only", default="interference,local_prefill,prefix,overhead")
    p.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    p.add_argument("--device", default="cpu", help="overhead only: the engines' device (cuda on a GPU host)")
    p.add_argument(
        "--dtype", default="float32", help="overhead only: weights and KV dtype (bfloat16 on a GPU)"
    )
    p.add_argument("--output", default=str(RESULTS / "serving_comparisons.json"))
    a = p.parse_args()
    out = {}
    for name in a.only.split(","):
        comparisons = {
            "interference": interference,
            "local_prefill": local_prefill,
            "prefix": prefix,
            "overhead": overhead,
            "default_flags": default_flags,
        }
        if name == "overhead":
            out[name] = overhead(a.quick, a.device, a.dtype)
        else:
            out[name] = comparisons[name](a.quick)
    print("\n==== ratios (one run each, this machine) ====")
    for name, res in out.items():
        for k, v in res.items():
            if k != "runs" and isinstance(v, float):
                print(f"{name:13s} {k}: {v:.2f}")
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    slim = json.loads(json.dumps(out))
    for res in slim.values():
        for run in res.get("runs", {}).values():
            run.pop("samples", None)
            run.pop("vllm", None)
    Path(a.output).write_text(json.dumps(slim, indent=1))
    print(f"wrote {a.output}")
    _plots(out, Path(a.output).with_suffix(""))
    if "overhead" in out:
        rate_plot(out["overhead"], Path(a.output).with_name(Path(a.output).stem + "_rate.png"))


def _plots(out: dict, prefix: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("interference", "itl_s", "ITL under interference"),
        ("local_prefill", "ttft_s", "TTFT, conditional disaggregation"),
        ("prefix", "ttft_s", "TTFT on the prefix workload"),
        ("overhead", "e2e_s", "E2E latency, short requests"),
    ]
    panels = [pn for pn in panels if pn[0] in out]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    axes = axes if len(panels) > 1 else [axes]
    for ax, (name, key, title) in zip(axes, panels):
        for label, run in out[name]["runs"].items():
            xs = sorted(v * 1000 for v in run["samples"][key])
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
        ax.set_xscale("log")
        ax.set_xlabel("ms")
        ax.set_title(f"{title} (CDF)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = prefix.parent / f"{prefix.name}.png"
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def rate_plot(res: dict, path: Path) -> None:
    """Requests/s of every path as a fraction of the engine alone at the same concurrency, the issue's
    targets (0.75x aggregated, 0.6x disaggregated) and the minimal server's ceiling drawn across."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engine = res["engine_alone_closed_loop_requests_per_s"]
    names = sorted(res["runs"], key=lambda n: res["runs"][n]["request_throughput"])
    ratios = [res["runs"][n]["request_throughput"] / engine for n in names]
    colors = ["tab:gray" if n.startswith("minimal") else "tab:blue" for n in names]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.5))
    ax.barh(names, ratios, color=colors)
    for y, r in enumerate(ratios):
        ax.text(r + 0.01, y, f"{r:.2f}x", va="center", fontsize=8)
    for x, label, style in ((0.75, "target, aggregated", "--"), (0.6, "target, disaggregated", ":")):
        ax.axvline(x, color="tab:red", linestyle=style, label=label)
    ax.set_xlim(0, 1.0)
    ax.set_xlabel(f"requests/s over the engine alone at 32 in flight ({engine:.1f} req/s)")
    ax.set_title(
        "Short requests over HTTP vs the engine alone\n(grey: the minimal one-process server)", fontsize=10
    )
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
