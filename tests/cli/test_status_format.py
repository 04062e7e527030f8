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


def test_status_json_keeps_zeros_and_numbers_and_hides_nixl_blobs_and_addresses():
    import json

    from cli.service_record import ServiceRecord
    from cli.service_target import Target
    from cli.status import status_json

    transfer = pb.KVTransferInfo(
        agent_name="a0", agent_metadata=b"\x00nixl-blob", base_addr=140234567, num_blocks=8
    )
    idle = pb.WorkerState(
        role="prefill",
        worker_id="p0",
        epoch=2**40,  # uint64: MessageToDict would write "1099511627776"
        pid=4321,
        transfer=transfer,
        stats=pb.EngineStats(num_blocks=8, num_free_blocks=8, kv_usage=0.1),
    )
    cluster = pb.ClusterState(policy="cache_aware", workers=[pb.WorkerSummary(state=idle, healthy=True)])
    record = ServiceRecord(
        "svc", "pdserve", "http://127.0.0.1:8000", "10.0.0.1:6379", pid=1, auth_token="tok"
    )
    out = json.loads(json.dumps(status_json(Target("10.0.0.1:6379", "pdserve", record), cluster, [idle])))
    assert out["service"] == {
        "name": "svc",
        "endpoint": "http://127.0.0.1:8000",
        "rayAddress": "10.0.0.1:6379",
        "app": "pdserve",
    }
    (w,) = out["workers"]
    assert w["epoch"] == 2**40 and w["pid"] == 4321  # numbers, not strings
    assert w["stats"]["numRunning"] == 0 and w["stats"]["numPreemptions"] == 0  # zeros kept
    assert w["stats"]["kvUsage"] == 0.1 and w["draining"] is False
    assert out["cluster"]["degraded"] is False and out["cluster"]["requestsRouted"] == 0
    assert out["cluster"]["workers"][0]["state"]["transfer"] == w["transfer"]
    assert w["transfer"]["agentName"] == "a0" and w["transfer"]["numBlocks"] == 8
    text = json.dumps(out)
    assert "agentMetadata" not in text and "baseAddr" not in text and "140234567" not in text
    assert "tok" not in json.dumps(out["service"])


def test_status_prints_migrations_and_suspect_workers():
    cluster = pb.ClusterState(
        policy="cache_aware",
        migrations=3,
        stalls=1,
        migrations_refused=2,
        suspect_workers=["decode-b"],
        peer_reads=5,
    )
    head = format_status(cluster, []).splitlines()[0]
    assert "migrations 3 (stalls 1, refused 2)" in head and "suspect: decode-b" in head
    assert "peer reads 5" in head
    assert "suspect" not in format_status(pb.ClusterState(policy="cache_aware"), []).splitlines()[0]


def test_status_prints_speculation_per_worker_that_speculates():
    spec = pb.EngineStats(
        num_blocks=8, spec_num_drafts=10, spec_draft_tokens=30, spec_accepted_tokens=12,
        spec_accepted_per_position=[7, 4, 1],
    )  # fmt: skip
    workers = [
        pb.WorkerState(role="decode", worker_id="d0", stats=spec),
        pb.WorkerState(role="prefill", worker_id="p0", stats=pb.EngineStats(num_blocks=8)),
    ]
    lines = format_status(pb.ClusterState(policy="cache_aware"), workers).splitlines()
    at = lines.index("speculative decoding:")
    assert lines[at + 2].split() == ["d0", "10", "12/30", "(40%)", "2.20", "70%", "40%", "10%"]
    assert len(lines) == at + 3  # the prefill worker does not speculate: no row
    plain = [pb.WorkerState(role="decode", worker_id="d0", stats=pb.EngineStats(num_blocks=8))]
    assert "speculative" not in format_status(pb.ClusterState(policy="cache_aware"), plain)


def test_status_json_answers_alone_on_stdout_while_ray_prints_the_clusters_errors(monkeypatch, capsys):
    """Ray's driver prints the cluster's error messages (a raylet's lagging heartbeats under load) to
    ``sys.stdout`` from a thread; ``--json`` keeps them off the stdout its reader parses."""
    import json
    import sys

    from ray._private.worker import print_to_stdstream

    from cli.ray_cluster import stdout_for_results

    monkeypatch.setattr(sys, "stdout", sys.stdout)  # restored after the test
    results = stdout_for_results()
    said = {"lines": ["(2) raylet has lagging heartbeats due to slow network or busy workload."]}
    print_to_stdstream({**said, "pid": "raylet", "is_err": False}, ignore_prefix=False)
    print(json.dumps({"workers": []}), file=results, flush=True)
    out, err = capsys.readouterr()
    assert out.splitlines() == ['{"workers": []}']
    assert "lagging heartbeats" in err
