"""The report of ``bench.host_overhead``: its table, the ratios against a baseline and the context
flatness per batch."""

from __future__ import annotations

import statistics

_COLUMNS = ("mean_ms", "p50_ms", "schedule_ms", "execute_ms", "update_ms", "other_ms")


def ratios(current: list[dict], baseline: list[dict]) -> list[dict]:
    old = {(r["batch"], r["context"]): r for r in baseline}
    out = []
    for r in current:
        b = old.get((r["batch"], r["context"]))
        if b is not None:
            ratio = {k: r[k] / b[k] if b[k] > 0 else float("nan") for k in _COLUMNS}
            out.append({"batch": r["batch"], "context": r["context"], **ratio})
    return out


def flatness(rows: list[dict], key: str = "mean_ms") -> dict[int, float]:
    """Per batch: the step's time at the longest context over its time at the shortest."""
    out = {}
    for batch in sorted({r["batch"] for r in rows}):
        mine = sorted((r for r in rows if r["batch"] == batch), key=lambda r: r["context"])
        if len(mine) > 1:
            out[batch] = mine[-1][key] / mine[0][key]
    return out


def format_report(result: dict, target_ms: float) -> str:
    cur = result["current"]
    base = result.get("baseline")
    lines = [f"engine step host time per decode step, zero-cost model on CPU ({cur['mode']})"]
    head = f"{'batch':>5} {'ctx':>5} {'steps':>5} {'mean':>8} {'p50':>8} {'sched':>7} {'exec':>7} {'update':>7} {'other':>7}"
    if base:
        head += f" {'old mean':>9} {'old p50':>8} {'new/old':>7} {'p50 n/o':>7}"
    lines += [head + "   (ms)", "-" * len(head)]
    old = {(r["batch"], r["context"]): r for r in base["rows"]} if base else {}
    for r in cur["rows"]:
        line = (
            f"{r['batch']:>5} {r['context']:>5} {r['steps']:>5} {r['mean_ms']:>8.3f} {r['p50_ms']:>8.3f} "
            f"{r['schedule_ms']:>7.3f} {r['execute_ms']:>7.3f} {r['update_ms']:>7.3f} {r['other_ms']:>7.3f}"
        )
        b = old.get((r["batch"], r["context"]))
        if b is not None:
            line += (
                f" {b['mean_ms']:>9.3f} {b['p50_ms']:>8.3f} {r['mean_ms'] / b['mean_ms']:>7.2f}"
                f" {r['p50_ms'] / b['p50_ms']:>7.2f}"
            )
        lines.append(line)
    for name, side in (("current", cur), ("baseline", base)):
        contexts = sorted({r["context"] for r in side["rows"]}) if side else []
        for key in ("mean_ms", "p50_ms") if len(contexts) > 1 else ():
            flat = ", ".join(f"batch {b}: {v:.2f}x" for b, v in flatness(side["rows"], key).items())
            lines.append(f"{name}: {contexts[-1]} / {contexts[0]} context ({key[:-3]}): {flat}")
    goal = next((r for r in cur["rows"] if (r["batch"], r["context"]) == (256, 4096)), None)
    if goal is not None:
        verdict = "meets" if goal["mean_ms"] <= target_ms else "misses"
        lines.append(
            f"target: batch 256 x 4k <= {target_ms} ms per step: {goal['mean_ms']:.3f} ms ({verdict})"
        )
        slots = {int(k): v for k, v in goal.get("by_slot_p50_ms", {}).items()}  # JSON keys are str
        n = len(slots)  # the block size, where the run timed a step at every slot
        if n > 2 and set(slots) == set(range(n)):  # the steps where the batch crosses a boundary
            between = statistics.median(v for k, v in slots.items() if 0 < k < n - 1)
            lines.append(
                f"  p50 by block slot: filling the block {slots[n - 1]:.3f} ms, opening one "
                f"{slots[0]:.3f}, the others {between:.3f}"
            )
    if base:
        lines.append(f"baseline: {base['ref']} ({base['commit'][:12]}, {base['mode']})")
    for r in cur["rows"]:
        for f in r.get("profile_top", ())[:10]:
            if f is r["profile_top"][0]:
                lines.append(f"cProfile, batch {r['batch']} x {r['context']} (own ms per step):")
            lines.append(f"  {f['own_ms_per_step']:8.4f}  {f['calls_per_step']:8.1f} calls  {f['function']}")
    return "\n".join(lines)


def plot(
    runs: list[dict], path, target_ms: float, labels: tuple[str, str] = ("baseline", "this tree")
) -> None:
    """Step time against context, a panel per batch: each side's mean (solid) and p50 (dashed),
    the minimum over ``runs`` (results with ``current`` and ``baseline`` rows), and the target at
    the largest batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def best(side: str) -> dict[tuple[int, int], dict]:
        out: dict[tuple[int, int], dict] = {}
        for run in runs:
            for r in run.get(side, {}).get("rows", []):
                key = (r["batch"], r["context"])
                old = out.get(key)
                out[key] = r if old is None else {k: min(old[k], r[k]) for k in ("mean_ms", "p50_ms")}
        return out

    sides = [(label, best(side)) for side, label in zip(("baseline", "current"), labels)]
    batches = sorted({b for _, rows in sides for b, _ in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.6), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for (label, rows), color in zip(sides, ("tab:gray", "tab:blue")):
            ctx = sorted(c for b, c in rows if b == batch)
            if ctx:
                ax.plot(
                    ctx, [rows[(batch, c)]["mean_ms"] for c in ctx], "o-", color=color, label=f"{label}, mean"
                )
                ax.plot(
                    ctx, [rows[(batch, c)]["p50_ms"] for c in ctx], "s--", color=color, label=f"{label}, p50"
                )
        if batch == batches[-1]:
            ax.axhline(target_ms, color="tab:red", linestyle=":", label=f"target {target_ms} ms")
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("host ms per decode step")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("Engine step host time, zero-cost model on CPU (min over runs)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """``python -m bench.host_overhead_report --plot OUT.png RESULT.json ...``: a picture of stored
    results (files of ``bench.host_overhead --json``, or of several runs under ``runs``)."""
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+")
    parser.add_argument("--plot", required=True)
    parser.add_argument("--target-ms", type=float, default=0.3)
    parser.add_argument(
        "--labels", default="baseline,this tree", help="the two sides' names, comma-separated"
    )
    args = parser.parse_args(argv)
    runs = []
    for name in args.results:
        data = json.loads(Path(name).read_text())
        runs.extend(data.get("runs", [data]))
    baseline, current = args.labels.split(",", 1)
    plot(runs, args.plot, args.target_ms, (baseline, current))


if __name__ == "__main__":
    main()
