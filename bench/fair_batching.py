"""Fair batching vs today's policy, aggregated serving under interference (issue 14, item 4).

The same server (``pdserve serve --mode aggregated``) started twice, once per scheduling policy:
``fifo`` (running decodes, then prefill chunks fill the step's whole token budget) and ``fair``
(the step's prefill allowance sized from measured step times to ``--itl-target-ms``, prompts served
by least attained service). The workload is the interference mix of ``bench.serving_comparisons``
(long prompts among short chat turns, closed loop), so a long prompt's prefill lands in the steps of
running decodes. Reported for both: ITL p99, TTFT p99 (and by prompt length), TPOT, goodput, request
throughput, and their ratios.

    python -m bench.fair_batching [--quick] [--decode 1] [--itl-target-ms 100]

Results: bench/results/fair_batching.json and a CDF plot of ITL and TTFT next to it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.serving_comparisons import interference_args, load, serving
from loadgen.vllm_result import percentile

RESULTS = Path(__file__).parent / "results"
SHORT_MAX = 64  # prompt tokens: the chat turns are 32, the long prompts 768


def _pct(xs: list[float], p: float) -> float:
    return percentile(xs, p)  # interpolated, as every other figure of pdserve bench's files


def _ttft_by_length(run: dict) -> dict[str, float]:
    v = run["vllm"]
    ok = [(n, t * 1000) for n, t, e in zip(v["input_lens"], v["ttfts"], v["errors"]) if not e]
    short = [t for n, t in ok if n <= SHORT_MAX]
    long_ = [t for n, t in ok if n > SHORT_MAX]
    return {
        "short_ttft_ms_median": _pct(short, 50),
        "short_ttft_ms_p99": _pct(short, 99),
        "long_ttft_ms_median": _pct(long_, 50),
        "long_ttft_ms_p99": _pct(long_, 99),
    }


def _figures(run: dict) -> dict[str, float]:
    return {
        "itl_ms_p99": run["itl_s"]["p99"] * 1000,
        "itl_ms_median": run["itl_s"]["median"] * 1000,
        "ttft_ms_p99": run["ttft_s"]["p99"] * 1000,
        "ttft_ms_median": run["ttft_s"]["median"] * 1000,
        "tpot_ms_mean": run["tpot_s"]["mean"] * 1000,
        "tpot_ms_p99": run["tpot_s"]["p99"] * 1000,
        "goodput_req_s": run["goodput"],
        "request_throughput_req_s": run["request_throughput"],
        "failed": run["failed"],
        **_ttft_by_length(run),
    }


def compare(quick: bool, decode: int, itl_target_ms: float | None, concurrency: int) -> dict:
    args = interference_args(quick)
    runs = {}
    for policy in ("fifo", "fair"):
        flags = ["--mode", "aggregated", "--decode", str(decode), "--scheduling-policy", policy]
        if policy == "fair" and itl_target_ms is not None:
            flags += ["--itl-target-ms", str(itl_target_ms)]
        with serving(*flags) as base:
            runs[policy] = load(base, args, concurrency=concurrency)
    figures = {name: _figures(run) for name, run in runs.items()}
    fifo, fair = figures["fifo"], figures["fair"]
    return {
        "setup": {
            "mode": "aggregated",
            "decode_workers": decode,
            "itl_target_ms": itl_target_ms,
            "concurrency": concurrency,
            "num_prompts": args.num_prompts,
            "goodput_slo_ms": args.goodput,
        },
        "figures": figures,
        "ratios_fair_over_fifo": {
            k: fair[k] / fifo[k] for k in fifo if k != "failed" and fifo[k] and isinstance(fifo[k], float)
        },
        "runs": runs,
    }


def _print(out: dict) -> None:
    figures, ratios = out["figures"], out["ratios_fair_over_fifo"]
    print(f"\n==== fair batching vs fifo ({out['setup']}) ====")
    print(f"{'':28s} {'fifo':>10s} {'fair':>10s} {'fair/fifo':>10s}")
    for k in figures["fifo"]:
        if k == "failed":
            continue
        ratio = f"{ratios[k]:10.2f}" if k in ratios else ""
        print(f"{k:28s} {figures['fifo'][k]:10.1f} {figures['fair'][k]:10.1f} {ratio}")
    print(f"failed requests: fifo {figures['fifo']['failed']}, fair {figures['fair']['failed']}")


def _plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in zip(axes, ("itl_s", "ttft_s"), ("ITL", "TTFT")):
        for policy, run in out["runs"].items():
            xs = sorted(v * 1000 for v in run["samples"][key])
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=policy)
        ax.set_xscale("log")
        ax.set_xlabel("ms")
        ax.set_title(f"{title}, aggregated, interference mix (CDF)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.fair_batching", description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    p.add_argument("--decode", type=int, default=1, help="aggregated workers")
    p.add_argument(
        "--itl-target-ms", type=float, default=None, help="fair policy's target (default: engine's)"
    )
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--output", default=str(RESULTS / "fair_batching.json"))
    a = p.parse_args()
    out = compare(a.quick, a.decode, a.itl_target_ms, a.concurrency)
    _print(out)
    path = Path(a.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    slim = {k: v for k, v in out.items() if k != "runs"}
    path.write_text(json.dumps(slim, indent=1))
    print(f"wrote {path}")
    _plot(out, path.with_suffix(".png"))


if __name__ == "__main__":
    main()
