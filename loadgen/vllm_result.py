"""A run's results under the field names of ``vllm bench serve``'s JSON, so dashboards and scripts
written for vLLM's benchmark read ``pdserve bench --output-json`` as they are.

Names follow vLLM's result file: ``duration``, ``completed``, ``failed``, ``total_input_tokens``,
``total_output_tokens``, ``request_throughput``, ``request_goodput``, ``output_throughput``,
``total_token_throughput``, per-request ``input_lens`` / ``output_lens`` / ``ttfts`` / ``itls`` /
``errors``, ``max_concurrency``, ``request_rate``, ``burstiness``, ``num_prompts``, ``model_id``,
``backend``, ``date``; and for each of ``ttft``, ``tpot``, ``itl``, ``e2el``: ``mean_<m>_ms``,
``median_<m>_ms``, ``std_<m>_ms`` and ``p<N>_<m>_ms`` for N in ``PERCENTILES`` (vLLM's default
reports p99; p90 and p95 are added). Times are seconds in the per-request lists, milliseconds in
the summaries, as in vLLM.
"""

from __future__ import annotations

import datetime
import json
import statistics
from pathlib import Path

PERCENTILES = (90, 95, 99)


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default, which vLLM uses)."""
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def latency_fields(name: str, seconds: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in seconds]
    out = {
        f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
        f"median_{name}_ms": statistics.median(ms) if ms else 0.0,
        f"std_{name}_ms": statistics.pstdev(ms) if ms else 0.0,
    }
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = percentile(ms, p)
    return out


def vllm_fields(results, elapsed: float, goodput_per_s: float | None, concurrency, rate, burstiness) -> dict:
    """``results``: every request's ``RequestResult`` (failed ones included, as vLLM counts them)."""
    ok = [r for r in results if r.ok]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    out = {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai",
        "num_prompts": len(results),
        "request_rate": rate if rate else "inf",
        "burstiness": burstiness,
        "max_concurrency": concurrency,
        "duration": elapsed,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / elapsed if elapsed else 0.0,
        "request_goodput": goodput_per_s,
        "output_throughput": total_out / elapsed if elapsed else 0.0,
        "total_token_throughput": (total_in + total_out) / elapsed if elapsed else 0.0,
        "input_lens": [r.prompt_tokens for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft_s for r in results],
        "itls": [list(r.itl_s) for r in results],
        "errors": [r.error for r in results],
    }
    out |= latency_fields("ttft", [r.ttft_s for r in ok])
    out |= latency_fields("tpot", [r.tpot_s for r in ok if r.output_tokens > 1])
    out |= latency_fields("itl", [g for r in ok for g in r.itl_s])
    out |= latency_fields("e2el", [r.e2e_s for r in ok])
    return out


def write_results(path: str, runs: list[dict], result: dict, args) -> list[str]:
    """vLLM's result file at ``path`` (``vllm bench serve`` field names, pdserve's own summary under
    ``"pdserve"``); a sweep writes one such file per level (``<path stem>.c<N>.json``) and, at
    ``path``, ``{"runs": [...]}`` of them."""
    meta = {"dataset": result["dataset"], "base_url": result["base_url"]}
    meta["args"] = {k: v for k, v in vars(args).items() if k not in ("api_key", "func")}

    def flat(run: dict) -> dict:
        pdserve = {k: v for k, v in run.items() if k not in ("vllm", "samples")}
        return run["vllm"] | {"pdserve": pdserve | meta}

    target = Path(path)
    written = []
    if len(runs) == 1:
        payload = flat(runs[0])
    else:
        for run in runs:
            level = target.with_name(f"{target.stem}.c{run['concurrency']}{target.suffix or '.json'}")
            level.write_text(json.dumps(flat(run), default=str))
            written.append(str(level))
        payload = {"runs": [flat(r) for r in runs]}
    target.write_text(json.dumps(payload, default=str))
    return [*written, str(target)]
