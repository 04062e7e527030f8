"""A worker's membership in the registry: its record, and its engine's KV events fed to Redis.

The engine thread runs ``tick()`` every loop iteration: it turns the engine's block events into the
registry's event kinds and hands them (or, after a reconnect, a snapshot of the whole prefix cache)
to the ``RegistryPublisher``'s queue; the publisher's thread does every Redis call.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from engine.block_pool import DISK, HOST, AllBlocksCleared, BlockRemoved, BlockStored
from engine.engine_core import EngineCore
from engine.limits import RequestLimits
from kv_transfer import KVCompat
from registry.publisher import RegistryPublisher
from registry.schema import (
    CLEARED,
    DISK_REMOVED,
    DISK_STORED,
    HOST_REMOVED,
    HOST_STORED,
    REMOVED,
    STORED,
    WorkerRecord,
    connect,
    read_workers,
)

_KINDS = {BlockStored: STORED, BlockRemoved: REMOVED, AllBlocksCleared: CLEARED}
_TIER_KINDS = {
    HOST: {BlockStored: HOST_STORED, BlockRemoved: HOST_REMOVED},
    DISK: {BlockStored: DISK_STORED, BlockRemoved: DISK_REMOVED},
}


class RegistryLink:
    def __init__(
        self, core: EngineCore, publisher: RegistryPublisher, recent_step_s: Callable[[], float] = lambda: 0.0
    ) -> None:
        self.core = core
        self.publisher = publisher
        self.recent_step_s = recent_step_s  # the engine loop's step budget (engine.step_budget)
        self.stopped = False

    def tick(self) -> None:
        """Engine thread only; a no-op once stopped (nothing reads the publisher's queue then)."""
        if self.stopped:
            return
        core, pub = self.core, self.publisher
        events = core.drain_kv_events()
        if pub.snapshot_wanted():
            pub.offer_snapshot(*core.cached_hashes())
        else:
            pub.offer_events(event_batches(events))
        if pub.load_due():
            s = core.stats()
            pub.offer_load(
                num_running=s.num_running,
                num_waiting=s.num_waiting,
                num_free_blocks=s.num_free_blocks,
                queued_prompt_tokens=core.pending_prompt_tokens(),
                step_ms=int(self.recent_step_s() * 1000),
                host_hit_cost_pct=core.host_hit_cost_pct(),
                disk_hit_cost_pct=core.disk_hit_cost_pct(),
                peer_hit_cost_pct=core.peer_hit_cost_pct(),
                resident_loras=json.dumps(core.resident_loras()),
            )

    def stop(self) -> None:
        self.stopped = True
        self.publisher.stop()  # deregisters


def event_batches(events: list) -> list[tuple[str, list[bytes]]]:
    """The engine's block events as registry batches: consecutive events of one kind merged, order kept."""
    out: list[tuple[str, list[bytes]]] = []
    for ev in events:
        kind = _TIER_KINDS.get(getattr(ev, "tier", None), _KINDS)[type(ev)]
        hashes = [] if kind == CLEARED else list(ev.block_hashes)
        if out and out[-1][0] == kind and kind != CLEARED:
            out[-1][1].extend(hashes)
        else:
            out.append((kind, hashes))
    return out


class IncompatibleKVLayoutError(RuntimeError):
    """Workers of one model registered with KV block layouts that differ: their KV cannot move."""


def worker_record(
    worker_id: str,
    role: str,
    address: str,
    epoch: int,
    compat: KVCompat,
    limits: RequestLimits,
    salt: str,
    kv_handoff: bool = True,
    loras: dict[str, str] | None = None,
    streams: str = "",
    prefix_caching: bool = True,
) -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id,
        role=role,
        address=address,
        epoch=epoch,
        model=compat.model,
        block_size=limits.block_size,
        num_blocks=limits.num_blocks,
        max_model_len=limits.max_model_len,
        cache_salt=salt,
        kv_compat=compat.hash(),
        kv_layout=describe_layout(compat),
        kv_handoff=int(kv_handoff),
        loras=json.dumps(loras or {}, sort_keys=True),
        streams=streams,
        prefix_caching=int(prefix_caching),
    )


def describe_layout(c: KVCompat) -> str:
    return f"{c.dtype} blocks of {c.block_size} tokens, {c.num_layers} layers x {c.num_kv_heads} KV heads x {c.head_dim}"


def check_joins(redis_url: str, record: WorkerRecord) -> None:
    """Refuse to join a pool whose registered workers of the same model keep their KV in another
    layout (KV dtype, ``kv_cache_dtype``, block size): a prefill/decode pair of those could never move
    KV, so the worker fails at start with this error instead of failing each request. Blocking."""
    client = connect(redis_url)
    try:
        others = read_workers(client)
    finally:
        client.close()
    clash = sorted(
        w.worker_id
        for w in others.values()
        if w.model == record.model
        and w.worker_id != record.worker_id
        and w.kv_compat not in ("", record.kv_compat)
    )
    if clash:
        theirs = {w.kv_layout for w in others.values() if w.worker_id in clash}
        raise IncompatibleKVLayoutError(
            f"{record.role} worker {record.worker_id} keeps the KV of {record.model} as {record.kv_layout}, "
            f"but registered workers {', '.join(clash)} keep it as {'; '.join(sorted(theirs))}. "
            "Every worker of a model needs the same dtype, kv_cache_dtype and block_size: "
            "start it with the pool's settings, or drain the others first."
        )
