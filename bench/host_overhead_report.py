"""The report of ``bench.host_overhead``: its table, the ratios against a baseline and the context
flatness per batch."""

from __future__ import annotations

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
    if base:
        lines.append(f"baseline: {base['ref']} ({base['commit'][:12]}, {base['mode']})")
    for r in cur["rows"]:
        for f in r.get("profile_top", ())[:10]:
            if f is r["profile_top"][0]:
                lines.append(f"cProfile, batch {r['batch']} x {r['context']} (own ms per step):")
            lines.append(f"  {f['own_ms_per_step']:8.4f}  {f['calls_per_step']:8.1f} calls  {f['function']}")
    return "\n".join(lines)
