"""``pdserve status`` prints the router's per-hop summary (mean / p50 / p90 over its recent
requests) under the worker table, and nothing of it before any request went through."""

from __future__ import annotations

from cli.status import format_status
from proto import pdserve_pb2 as pb


def test_status_prints_the_hop_summary_when_the_router_has_one():
    worker = pb.WorkerState(
        role="decode", worker_id="d0", stats=pb.EngineStats(num_blocks=8, num_free_blocks=8)
    )
    idle = format_status(pb.ClusterState(policy="cache_aware"), [worker])
    assert "where the time went" not in idle and "d0" in idle
    hops = [
        pb.HopSummary(hop="route", count=40, mean_ms=0.05, p50_ms=0.04, p90_ms=0.09),
        pb.HopSummary(hop="kv_transfer", count=39, mean_ms=2.5, p50_ms=2.25, p90_ms=4.0),
    ]
    text = format_status(pb.ClusterState(policy="cache_aware", hop_timing=hops), [worker])
    lines = text.splitlines()
    at = lines.index("where the time went (last 40 requests through the router):")
    assert lines[at + 1].split() == ["HOP", "REQUESTS", "MEAN", "MS", "P50", "MS", "P90", "MS"]
    assert lines[at + 2].split() == ["route", "40", "0.05", "0.04", "0.09"]
    assert lines[at + 3].split() == ["kv_transfer", "39", "2.50", "2.25", "4.00"]
