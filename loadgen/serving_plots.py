"""PNG plots of ``pdserve bench`` runs: latency CDFs per run, and throughput / latency against
concurrency when the runs form a sweep. matplotlib with the Agg backend (no display needed)."""

from __future__ import annotations

from pathlib import Path


def plot_runs(runs: list[dict], prefix: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for s in runs:
        label = f"c={s['concurrency']}" if s["concurrency"] else f"rate={s['request_rate']}/s"
        for ax, key, title in zip(axes, ("ttft_s", "itl_s", "e2e_s"), ("TTFT", "ITL", "E2E latency")):
            xs = sorted(v * 1000 for v in s["samples"][key])
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
            ax.set_title(f"{title} CDF")
            ax.set_xlabel("ms")
            ax.set_ylabel("fraction of requests" if key != "itl_s" else "fraction of token gaps")
            ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    path = Path(f"{prefix}_latency_cdf.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    if len(runs) > 1 and all(s["concurrency"] for s in runs):
        c = [s["concurrency"] for s in runs]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        a1.plot(c, [s["output_token_throughput"] for s in runs], "o-", label="output tokens/s")
        a1b = a1.twinx()
        a1b.plot(c, [s["request_throughput"] for s in runs], "s--", color="tab:orange", label="requests/s")
        a1.set_xlabel("concurrency")
        a1.set_ylabel("output tokens/s")
        a1b.set_ylabel("requests/s")
        a1.set_title("Throughput vs concurrency")
        for key, style in (("ttft_s", "o-"), ("itl_s", "s-"), ("e2e_s", "^-")):
            a2.plot(c, [s[key]["median"] * 1000 for s in runs], style, label=f"{key[:-2].upper()} p50")
            a2.plot(
                c,
                [s[key]["p99"] * 1000 for s in runs],
                style.replace("-", ":"),
                label=f"{key[:-2].upper()} p99",
            )
        a2.set_xlabel("concurrency")
        a2.set_ylabel("ms")
        a2.set_yscale("log")
        a2.set_title("Latency vs concurrency")
        a2.legend(fontsize=7)
        for ax in (a1, a2):
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        path = Path(f"{prefix}_sweep.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
