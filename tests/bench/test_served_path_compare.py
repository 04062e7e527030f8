"""bench.served_path_compare: means over each side's runs and after/before ratios per layout."""

from __future__ import annotations

import pytest

from bench.served_path_compare import compare, summarize


def _run(decode: float, router: float, rate: float) -> dict:
    stack = {
        "requests_per_s": rate,
        "ttft_c1_p50_ms": 10.0,
        "cpu_ms_per_token": {"decode_worker": decode, "router": router},
        "stack_cpu_ms_per_token": decode + router,
        "cpu_over_minimal": (decode + router) / 0.1,
    }
    minimal = {
        "requests_per_s": 50.0,
        "cpu_ms_per_token": {"minimal_server": 0.1},
        "stack_cpu_ms_per_token": 0.1,
    }
    return {"workloads": {"16/16": {"minimal": minimal, "stack": stack}}}


def test_means_over_runs_and_ratios_per_process():
    before = summarize([_run(0.3, 0.2, 100.0), _run(0.5, 0.2, 120.0)])
    after = summarize([_run(0.2, 0.1, 200.0)])
    assert before["16/16"]["stack"]["cpu_ms_per_token"] == pytest.approx(
        {"decode_worker": 0.4, "router": 0.2}
    )
    assert before["16/16"]["stack"]["requests_per_s"] == pytest.approx(110.0)
    r = compare(before, after)["16/16"]["stack"]
    assert r["cpu_after_over_before"] == pytest.approx(0.3 / 0.6)
    assert r["cpu_after_over_before_by_process"] == pytest.approx({"decode_worker": 0.5, "router": 0.5})
    assert r["rate_after_over_before"] == pytest.approx(200.0 / 110.0)
