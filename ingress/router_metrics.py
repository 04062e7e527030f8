"""The router's Prometheus series, as the ingress exports them from the router's ``ClusterState``.

Every series is labelled by the router replica (``router``): several routers may answer one scrape
target (front ends sharing a port, each with its router inside; Serve's router replicas), and a
counter without it would jump between their values (read as resets). With it each router's
counters stay monotonic, and ``sum by (...)`` adds them up.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from proto import pdserve_pb2 as pb

_ROUTER_COUNTERS = (
    ("requests_routed", "requests_routed", "Requests the router has routed"),
    ("prompt_tokens", "prompt_tokens", "Prompt tokens routed (with the hit tokens: windowed hit ratios)"),
    (
        "predicted_hit_tokens",
        "predicted_hit_tokens",
        "Prompt tokens the router predicted as prefix-cache hits",
    ),
    (
        "delivered_hit_tokens",
        "delivered_hit_tokens",
        "Prompt tokens the engines delivered as prefix-cache hits",
    ),
    (
        "local_prefills",
        "local_prefills",
        "Requests prefilled on their decode worker (uncached prompt part under the threshold)",
    ),
    (
        "peer_reads",
        "peer_reads",
        "Prompts sent with a peer of the computing worker's role to read their prefix from (KV tiers)",
    ),
    (
        "kv_streamed",
        "kv_streamed",
        "Requests whose Decode, opened before their prefill (KV streaming), took the complete handle",
    ),
    (
        "migrations",
        "migrations",
        "Requests resumed on another decode worker after theirs was lost mid-stream",
    ),
    ("stalls", "stalls", "Decode streams and prefill calls given up on by the stall watch"),
    (
        "migrations_refused",
        "migrations_refused",
        "Requests whose decode worker was lost and that could not be resumed (limit, no other worker, n > 1)",
    ),
    ("prefill_retries", "prefill_retries", "Prefills retried on another prefill worker after one failed"),
    (
        "aggregated_fallbacks",
        "aggregated_fallbacks",
        "Requests run aggregated on their decode worker after every prefill attempt failed",
    ),
    (
        "decode_retries",
        "decode_retries",
        "Decode calls moved to another decode worker (the first was unreachable)",
    ),
    ("index_gaps", "gaps_detected", "Gaps in a worker's KV event sequence the router's index detected"),
    ("index_resyncs", "resyncs", "Times the router's index resynchronised a worker from its snapshot"),
)


def router_families(c: pb.ClusterState):
    rid = [c.router_id or "0"]
    r = GaugeMetricFamily(
        "pdserve_router_prefix_hit_ratio",
        "Prompt tokens the router predicted / the engines delivered as prefix-cache hits, since the "
        "router started (rate() of the hit-token counters over prompt_tokens gives a window's)",
        labels=["router", "kind"],
    )
    r.add_metric([*rid, "predicted"], c.predicted_prefix_hit_rate)
    r.add_metric([*rid, "delivered"], c.delivered_prefix_hit_rate)
    yield r
    for name, field_name, doc in _ROUTER_COUNTERS:
        family = CounterMetricFamily(f"pdserve_router_{name}", doc, labels=["router"])
        family.add_metric(rid, getattr(c, field_name))
        yield family
    failed = CounterMetricFamily(
        "pdserve_router_failed_requests",
        "Requests the router could not serve, by the gRPC status they ended with",
        labels=["router", "code"],
    )
    for code, n in sorted(c.failed_by_code.items()):
        failed.add_metric([*rid, code], n)
    yield failed
    for name, doc, value in (
        ("active_requests", "Generate streams open on the router", c.active_requests),
        ("degraded", "1 while the registry (Redis) is unreachable", float(c.degraded)),
        ("event_lag_seconds", "Age of the newest KV event the router's index applied", c.event_lag_seconds),
    ):
        family = GaugeMetricFamily(f"pdserve_router_{name}", doc, labels=["router"])
        family.add_metric(rid, value)
        yield family
