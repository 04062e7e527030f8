"""``pdserve status``: the router's view and one row per worker of a running service."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging

from cli.app_client import router_client


def add_parser(sub) -> None:
    st = sub.add_parser("status", help="workers, roles, load, KV usage and hit rates of a running service")
    st.add_argument("--address", default=None, help="Ray cluster address (default: the local one)")
    st.add_argument("--app", default="pdserve", help="Serve application name")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import ray

    ray.init(address=args.address or "auto", logging_level=logging.ERROR, log_to_driver=False)
    try:
        cluster, states = asyncio.run(_status(args.app))
    finally:
        ray.shutdown()
    if args.json:
        from google.protobuf.json_format import MessageToDict

        print(json.dumps({"cluster": MessageToDict(cluster), "workers": [MessageToDict(w) for w in states]}))
        return 0
    print(format_status(cluster, states))
    return 0


async def _status(app_name: str):
    client = await router_client(app_name)
    try:
        return await client.worker_states()
    finally:
        await client.close()


def format_status(cluster, states) -> str:
    head = (
        f"router: policy {cluster.policy}, registry {'DEGRADED' if cluster.degraded else 'ok'}"
        f"{', DRAINING' if cluster.draining else ''}; {cluster.requests_routed} requests routed, "
        f"{cluster.active_requests} active; prefix hits predicted {cluster.predicted_prefix_hit_rate:.0%} / "
        f"delivered {cluster.delivered_prefix_hit_rate:.0%}; retries {cluster.prefill_retries}, "
        f"aggregated fallbacks {cluster.aggregated_fallbacks}, local prefills {cluster.local_prefills}, "
        f"failed {cluster.failed_requests}"
    )
    rows = [("ROLE", "WORKER", "ADDRESS", "PID", "RUN", "WAIT", "HELD", "KV USED", "HIT RATE", "PREEMPT")]
    for w in sorted(states, key=lambda w: (w.role, w.worker_id)):
        s = w.stats
        hit = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        used = s.num_blocks - s.num_free_blocks
        rows.append(
            (
                w.role + (" (draining)" if w.draining else ""),
                w.worker_id,
                w.address,
                str(w.pid),
                str(s.num_running),
                str(s.num_waiting),
                str(s.num_held_requests),
                f"{used}/{s.num_blocks} ({s.kv_usage:.0%})",
                f"{hit:.0%}",
                str(s.num_preemptions),
            )
        )
    out = f"{head}\n{_table(rows)}"
    if cluster.hop_timing:
        out += "\n\n" + format_hops(cluster.hop_timing)
    return out


def format_hops(hops) -> str:
    """Per hop, over the router's recent finished requests (the ingress's own hops are in its
    /metrics, ``pdserve_hop_seconds``)."""
    n = max(h.count for h in hops)
    rows = [("HOP", "REQUESTS", "MEAN MS", "P50 MS", "P90 MS")]
    for h in hops:
        rows.append((h.hop, str(h.count), f"{h.mean_ms:.2f}", f"{h.p50_ms:.2f}", f"{h.p90_ms:.2f}"))
    return f"where the time went (last {n} requests through the router):\n{_table(rows)}"


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
