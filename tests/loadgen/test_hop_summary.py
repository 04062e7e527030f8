"""``pdserve bench --debug-timing``: each request's server-side hop timing is summarised per hop,
with the HTTP proxy's share computed at the client (its TTFT less the ingress's)."""

from __future__ import annotations

import pytest

from loadgen.serving_client import RequestResult, hop_summary, summarize


def test_hop_summary_adds_the_proxy_share_from_the_clients_ttft():
    results = [
        RequestResult(
            ok=True, output_tokens=2, ttft_s=0.010, e2e_s=0.02, timing_ms={"ttft": 7.0, "route": 0.1}
        ),
        RequestResult(
            ok=True, output_tokens=2, ttft_s=0.012, e2e_s=0.02, timing_ms={"ttft": 8.0, "route": 0.3}
        ),
        RequestResult(ok=True, output_tokens=2, ttft_s=0.011, e2e_s=0.02),  # no timing asked: left out
    ]
    hops = hop_summary(results)
    assert set(hops) == {"ttft", "route", "http_proxy", "client_ttft"}
    # http_proxy: 3.0 and 4.0 ms; interpolated like every other statistic of the output file
    assert [hops["http_proxy"]["median"], hops["http_proxy"]["p90"]] == pytest.approx([3.5, 3.9])
    s = summarize(results, 1.0, {}, 1, None)
    assert s["hop_timing_ms"] == hops and len(s["samples"]["timing_ms"]) == 2
