"""``pdserve status``: the router's view and one row per worker of a running service."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from cli.app_client import router_client
from cli.service_target import Target, add_target_args, choose_target

# Not for operators: NIXL's serialized agent metadata (bytes fields) and raw memory addresses.
HIDDEN_FIELDS = frozenset({"base_addr"})


def add_parser(sub) -> None:
    st = sub.add_parser("status", help="workers, roles, load, KV usage and hit rates of a running service")
    add_target_args(st)
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import ray

    from cli.ray_cluster import connect, stdout_for_results

    results = stdout_for_results() if args.json else sys.stdout
    target = choose_target(args)
    if not args.json:
        print(f"{target.describe()}\n", flush=True)
    from deploy.scaling import describe_replicas, replica_resources, replica_states

    connect(target)
    try:
        cluster, states = asyncio.run(_status(target))
        replicas = replica_states(target.app_name)
        line = describe_replicas(replicas, replica_resources(target.app_name), ray.available_resources())
    finally:
        ray.shutdown()
    if args.json:
        out = status_json(target, cluster, states)
        out["replicas"] = {name: {"running": r, "target": t} for name, (r, t) in replicas.items()}
        print(json.dumps(out), file=results, flush=True)
        return 0
    print(format_status(cluster, states) + "\n\n" + line)
    return 0


async def _status(target: Target):
    try:
        client = await router_client(target.app_name)
    except Exception as exc:  # no such application, or its router is not up (yet)
        first = next((x for x in str(exc).splitlines() if x.strip()), type(exc).__name__)
        raise ConnectionError(
            f"no router of application {target.app_name!r} answers: {first.strip()}"
        ) from None
    try:
        return await client.worker_states()
    finally:
        await client.close()


def status_json(target: Target, cluster, states) -> dict:
    service = {"name": None, "endpoint": None}
    if target.record is not None:
        service = {"name": target.record.name, "endpoint": target.record.endpoint}
    service.update(rayAddress=target.ray_address, app=target.app_name)
    return {"service": service, "cluster": to_plain(cluster), "workers": [to_plain(w) for w in states]}


def to_plain(message) -> dict:
    """A message as JSON values: every field, zeros and falses included, integers as numbers (unlike
    ``MessageToDict``, which drops defaults and writes 64-bit integers as strings); keys in the
    JSON (camelCase) names; bytes and ``HIDDEN_FIELDS`` left out."""
    out = {}
    for field in message.DESCRIPTOR.fields:
        if field.type == field.TYPE_BYTES or field.name in HIDDEN_FIELDS:
            continue
        value = getattr(message, field.name)
        if field.type == field.TYPE_MESSAGE:
            value = [to_plain(v) for v in value] if field.is_repeated else to_plain(value)
        elif field.type == field.TYPE_ENUM:
            names = field.enum_type.values_by_number
            value = [names[v].name for v in value] if field.is_repeated else names[value].name
        elif field.type == field.TYPE_FLOAT:  # float32: no spurious digits (0.1, not 0.10000000149)
            value = [_f32(v) for v in value] if field.is_repeated else _f32(value)
        elif field.is_repeated:
            value = list(value)
        out[field.json_name] = value
    return out


def _f32(value: float) -> float:
    return float(f"{value:.7g}")


def format_status(cluster, states) -> str:
    head = (
        f"router: policy {cluster.policy}, registry {'DEGRADED' if cluster.degraded else 'ok'}"
        f"{', DRAINING' if cluster.draining else ''}; {cluster.requests_routed} requests routed, "
        f"{cluster.active_requests} active; prefix hits predicted {cluster.predicted_prefix_hit_rate:.0%} / "
        f"delivered {cluster.delivered_prefix_hit_rate:.0%}; retries {cluster.prefill_retries}, "
        f"aggregated fallbacks {cluster.aggregated_fallbacks}, local prefills {cluster.local_prefills}, "
        f"KV streamed {cluster.kv_streamed}, peer reads {cluster.peer_reads}, "
        f"failed {cluster.failed_requests}; migrations {cluster.migrations} "
        f"(stalls {cluster.stalls}, refused {cluster.migrations_refused})"
        + (f"; suspect: {', '.join(cluster.suspect_workers)}" if cluster.suspect_workers else "")
    )
    live = {w.worker_id for w in states}
    gone = [w for w in cluster.indexed if w.worker_id not in live]  # dropped after the grace period
    if gone:
        head += "; index still holds " + ", ".join(
            f"{w.worker_id} ({w.blocks + w.host_blocks + w.disk_blocks} blocks)" for w in gone
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
    tiers = format_cache_tiers(states)
    if tiers:
        out += "\n\n" + tiers
    spec = format_speculation(states)
    if spec:
        out += "\n\n" + spec
    if cluster.hop_timing:
        out += "\n\n" + format_hops(cluster.hop_timing)
    return out


def format_cache_tiers(states) -> str:
    """Per worker with a host tier: prompt tokens served by each tier, the tiers' use and the blocks
    copied into them (a disk tier's columns read ``-`` on a worker without one), and the blocks read
    from peers' tiers and lent to peers (prefill workers among themselves; decode workers when
    aggregated)."""
    host = ("HOST HITS", "HOST TIER USED", "OFFLOADED")
    disk = ("DISK HITS", "DISK TIER USED", "WRITTEN")
    rows = [("WORKER", "PROMPT TOKENS", "DEVICE HITS", *host, *disk, "FROM PEERS", "LENT")]
    for w in sorted(states, key=lambda w: w.worker_id):
        s = w.stats
        if not s.host_cache_blocks:
            continue
        queries = max(s.prefix_cache_queries, 1)
        device = s.prefix_cache_hits - s.prefix_cache_hits_host - s.prefix_cache_hits_disk
        disk = ("-", "-", "-")
        if s.disk_cache_blocks:
            disk = (
                f"{s.prefix_cache_hits_disk} ({s.prefix_cache_hits_disk / queries:.0%})",
                f"{s.disk_cache_used}/{s.disk_cache_blocks}",
                str(s.disk_written_blocks),
            )
        rows.append(
            (
                w.worker_id,
                str(s.prefix_cache_queries),
                f"{device} ({device / queries:.0%})",
                f"{s.prefix_cache_hits_host} ({s.prefix_cache_hits_host / queries:.0%})",
                f"{s.host_cache_used}/{s.host_cache_blocks}",
                str(s.host_offloaded_blocks),
                *disk,
                str(s.peer_received_blocks),
                str(s.peer_lent_blocks),
            )
        )
    return f"prefix cache by tier:\n{_table(rows)}" if len(rows) > 1 else ""


def format_speculation(states) -> str:
    """Per speculating worker: acceptance rate, mean accepted length, acceptance per draft position."""
    rows = [("WORKER", "DRAFTS", "ACCEPTED", "MEAN LENGTH", "PER POSITION")]
    for w in sorted(states, key=lambda w: w.worker_id):
        s = w.stats
        if not s.spec_num_drafts:
            continue
        per_pos = " ".join(f"{n / s.spec_num_drafts:.0%}" for n in s.spec_accepted_per_position)
        rows.append(
            (
                w.worker_id,
                str(s.spec_num_drafts),
                f"{s.spec_accepted_tokens}/{s.spec_draft_tokens} ({s.spec_accepted_tokens / max(s.spec_draft_tokens, 1):.0%})",
                f"{1 + s.spec_accepted_tokens / s.spec_num_drafts:.2f}",
                per_pos,
            )
        )
    return f"speculative decoding:\n{_table(rows)}" if len(rows) > 1 else ""


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
