"""Two code versions' ``bench.served_path`` runs side by side: CPU per streamed token of each process,
the stack over the minimal server, request rate and TTFT at concurrency 1, means over the runs of
each side, with after/before ratios, and a bar chart of each layout's CPU per token split by process.

    python -m bench.served_path_compare --before B1.json B2.json --after A1.json A2.json \\
        [--output bench/results/served_path_ab_cpu.json] [--png bench/results/served_path_ab_cpu.png]

Run the two sides alternately on an otherwise idle machine (this one's cores differ in speed from
run to run); ``bench/README.md`` has the commands used.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

SERVED = ("minimal", "stack", "split", "split_rh", "disagg", "disagg_split", "disagg_split_rh")
PROCESS_ORDER = (
    "minimal_server", "prefill_worker", "prefill_engine_process", "decode_worker", "engine_process", "router",
    "ingress",
)  # fmt: skip


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def summarize(runs: list[dict]) -> dict:
    """workload -> layout -> the means over ``runs`` (CPU per process and total, rate, TTFTs)."""
    out: dict = {}
    for w in runs[0]["workloads"]:
        out[w] = {}
        for layout in runs[0]["workloads"][w]:
            rs = [r["workloads"][w][layout] for r in runs if layout in r["workloads"].get(w, {})]
            procs = sorted({p for r in rs for p in r["cpu_ms_per_token"]})
            out[w][layout] = {
                "runs": len(rs),
                "requests_per_s": _mean([r["requests_per_s"] for r in rs]),
                "ttft_c1_p50_ms": _mean([r.get("ttft_c1_p50_ms") for r in rs]),
                "cpu_ms_per_token": {p: _mean([r["cpu_ms_per_token"].get(p) for r in rs]) for p in procs},
                "stack_cpu_ms_per_token": _mean([r["stack_cpu_ms_per_token"] for r in rs]),
                "cpu_over_minimal": _mean([r.get("cpu_over_minimal") for r in rs]),
            }
    return out


def compare(before: dict, after: dict) -> dict:
    ratios: dict = {}
    for w, layouts in after.items():
        ratios[w] = {}
        for layout, a in layouts.items():
            b = before.get(w, {}).get(layout)
            if b is None:
                continue
            per = {
                p: a["cpu_ms_per_token"][p] / b["cpu_ms_per_token"][p]
                for p in a["cpu_ms_per_token"]
                if b["cpu_ms_per_token"].get(p)
            }
            ratios[w][layout] = {
                "cpu_after_over_before": a["stack_cpu_ms_per_token"] / b["stack_cpu_ms_per_token"],
                "cpu_after_over_before_by_process": per,
                "rate_after_over_before": a["requests_per_s"] / b["requests_per_s"],
            }
    return ratios


def print_report(before: dict, after: dict, ratios: dict) -> None:
    for w in after:
        print(f"\n== {w} tokens in/out: before -> after (means over runs) ==")
        print(
            f"{'layout':8} {'req/s':>15} {'TTFT c=1 ms':>13} {'CPU ms/token':>15} {'x':>6} {'÷minimal':>13}  by process"
        )
        for layout in SERVED:
            b, a = before.get(w, {}).get(layout), after[w].get(layout)
            if a is None or b is None:
                continue
            r = ratios[w][layout]
            procs = "  ".join(
                f"{p.replace('_worker', '').replace('engine_process', 'core')} "
                f"{b['cpu_ms_per_token'][p]:.3f}->{a['cpu_ms_per_token'][p]:.3f}"
                for p in PROCESS_ORDER
                if p in a["cpu_ms_per_token"] and p in b["cpu_ms_per_token"]
            )
            print(
                f"{layout:8} {b['requests_per_s']:6.1f}->{a['requests_per_s']:6.1f} "
                f"{b['ttft_c1_p50_ms'] or 0:5.1f}->{a['ttft_c1_p50_ms'] or 0:5.1f} "
                f"{b['stack_cpu_ms_per_token']:6.3f}->{a['stack_cpu_ms_per_token']:6.3f} "
                f"{r['cpu_after_over_before']:5.2f}x "
                f"{b['cpu_over_minimal']:5.2f}->{a['cpu_over_minimal']:5.2f}  {procs}"
            )


def plot(before: dict, after: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(after)
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.5), squeeze=False)
    colors = dict(
        zip(PROCESS_ORDER, ("#888888", "#4c72b0", "#8172b3", "#dd8452", "#937860", "#55a868", "#c44e52"))
    )
    for ax, w in zip(axes[0], workloads):
        labels, x = [], 0
        for layout in SERVED:
            for side, data in (("before", before), ("after", after)):
                r = data.get(w, {}).get(layout)
                if r is None:
                    continue
                bottom = 0.0
                for p in PROCESS_ORDER:
                    v = r["cpu_ms_per_token"].get(p)
                    if v:
                        ax.bar(
                            x,
                            v,
                            bottom=bottom,
                            color=colors[p],
                            label=p if x == 0 or p not in ax.get_legend_handles_labels()[1] else None,
                        )
                        bottom += v
                labels.append(f"{layout}\n{side}")
                x += 1
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_ylabel("CPU ms per streamed token")
        ax.set_title(f"{w} tokens in/out, zero-cost model, CPU")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.served_path_compare", description=__doc__)
    p.add_argument("--before", nargs="+", required=True, help="served_path JSON files of the old code")
    p.add_argument("--after", nargs="+", required=True, help="served_path JSON files of the new code")
    p.add_argument("--output", default=None, help="write the means and ratios here (JSON)")
    p.add_argument("--png", default=None, help="write the bar chart here")
    a = p.parse_args()
    before = summarize([json.loads(Path(f).read_text()) for f in a.before])
    after = summarize([json.loads(Path(f).read_text()) for f in a.after])
    ratios = compare(before, after)
    print_report(before, after, ratios)
    if a.output:
        Path(a.output).write_text(json.dumps({"before": before, "after": after, "ratios": ratios}, indent=1))
        print(f"wrote {a.output}")
    if a.png:
        plot(before, after, Path(a.png))


if __name__ == "__main__":
    main()
