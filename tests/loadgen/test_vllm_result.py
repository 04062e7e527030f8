"""``pdserve bench --output-json`` speaks ``vllm bench serve``'s field names, with its statistics."""

from __future__ import annotations

import json
import statistics
from types import SimpleNamespace

import pytest

from loadgen.serving_client import RequestResult, summarize
from loadgen.vllm_result import percentile, vllm_fields, write_results

# The names a dashboard built on vLLM's result files reads (the p99 ones are vLLM's defaults).
VLLM_NAMES = [
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
    "request_goodput", "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts",
    "itls", "errors", "max_concurrency", "request_rate", "burstiness", "num_prompts", "backend", "date",
    "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
    "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms",
]  # fmt: skip


def _results() -> list[RequestResult]:
    return [
        RequestResult(True, 10, 3, ttft_s=0.1, e2e_s=0.3, itl_s=[0.1, 0.1]),
        RequestResult(True, 20, 5, ttft_s=0.2, e2e_s=0.6, itl_s=[0.1, 0.1, 0.1, 0.1]),
        RequestResult(False, 0, 0, error="HTTP 503"),
    ]


@pytest.mark.parametrize("p", [0, 25, 50, 90, 99, 100])
def test_percentiles_interpolate_like_numpy(p):
    values = [5.0, 1.0, 9.0, 2.0, 7.0]
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    expected = s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)
    assert percentile(values, p) == pytest.approx(expected)


def test_fields_and_values():
    out = vllm_fields(_results(), elapsed=2.0, goodput_per_s=0.5, concurrency=4, rate=None, burstiness=1.0)
    assert set(VLLM_NAMES) <= set(out)
    assert (out["completed"], out["failed"], out["num_prompts"]) == (2, 1, 3)
    assert (out["total_input_tokens"], out["total_output_tokens"]) == (30, 8)
    assert out["request_throughput"] == 1.0 and out["output_throughput"] == 4.0
    assert out["total_token_throughput"] == 19.0 and out["request_goodput"] == 0.5
    assert out["request_rate"] == "inf" and out["errors"] == ["", "", "HTTP 503"]
    assert out["mean_ttft_ms"] == pytest.approx(150.0) and out["median_e2el_ms"] == pytest.approx(450.0)
    assert out["mean_tpot_ms"] == pytest.approx(statistics.fmean([100.0, 100.0]))
    assert out["p99_itl_ms"] == pytest.approx(100.0)


def test_written_file_is_flat_for_one_run_and_per_level_for_a_sweep(tmp_path):
    args = SimpleNamespace(base_url="http://x", dataset="random", api_key="secret", burstiness=1.0)
    runs = []
    for c in (1, 4):
        run = summarize(_results(), 2.0, {}, c, None)
        run["vllm"] = vllm_fields(_results(), 2.0, None, c, None, 1.0)
        runs.append(run)
    result = {"base_url": "http://x", "dataset": "random"}
    write_results(str(tmp_path / "one.json"), runs[:1], result, args)
    one = json.loads((tmp_path / "one.json").read_text())
    assert one["max_concurrency"] == 1 and one["pdserve"]["completed"] == 2
    assert "secret" not in (tmp_path / "one.json").read_text()  # the API key never lands in a file
    paths = write_results(str(tmp_path / "sweep.json"), runs, result, args)
    assert [p.rsplit("/", 1)[1] for p in paths] == ["sweep.c1.json", "sweep.c4.json", "sweep.json"]
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert [r["max_concurrency"] for r in sweep["runs"]] == [1, 4]


def test_one_median_per_file_whichever_section():
    """``pdserve bench --output-json`` wrote two different TTFT medians (nearest rank in the pdserve
    section, interpolated in vLLM's): both sections now agree, even-sized samples included."""
    results = [
        RequestResult(ok=True, output_tokens=4, ttft_s=t, e2e_s=t + 0.3) for t in (0.10, 0.15, 0.16, 0.40)
    ]
    ours = summarize(results, 1.0, {}, 4, None)
    theirs = vllm_fields(results, 1.0, None, 4, None, 1.0)
    assert ours["ttft_s"]["median"] * 1e3 == pytest.approx(theirs["median_ttft_ms"]) == pytest.approx(155.0)
    assert ours["ttft_s"]["p99"] * 1e3 == pytest.approx(theirs["p99_ttft_ms"])
    assert ours["e2e_s"]["p90"] * 1e3 == pytest.approx(theirs["p90_e2el_ms"])
