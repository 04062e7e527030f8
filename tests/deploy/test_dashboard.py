"""The Grafana dashboard queries only metrics pdserve exports, under their exact names."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from ingress.metrics import IngressMetrics
from proto import pdserve_pb2 as pb

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdserve-dashboard.json"


def exported_names() -> set[str]:
    m = IngressMetrics("model")
    m.observe_ttft(0.1)
    m.observe_token_gap(0.01, 1)
    m.observe_e2e(1.0)
    workers = [
        pb.WorkerState(worker_id="p", role="prefill", stats=pb.EngineStats(num_blocks=8)),
        pb.WorkerState(
            worker_id="d",
            role="decode",
            stats=pb.EngineStats(
                num_blocks=8,
                spec_num_drafts=4,
                spec_draft_tokens=8,
                spec_accepted_tokens=5,
                spec_accepted_per_position=[3, 2],
            ),
            transfer_stats=pb.KVTransferStats(bucket_bounds=[0.1], bucket_counts=[1, 0]),
        ),
    ]
    text = m.render(pb.ClusterState(), workers, ("i", 0, 0)).decode()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_dashboard_queries_exported_metrics():
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"pdserve_[a-z0-9_]+", e)}
    assert used and used <= exported_names(), used - exported_names()
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
