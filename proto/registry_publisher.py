"""A worker's link to the registry: register, heartbeat its load, publish its KV events in order.

The engine thread calls ``engine_tick(core)`` every loop iteration: it drains the engine's block
events into a queue (never touching Redis) and, when asked, snapshots the prefix cache. A publisher
thread drains the queue into Redis. When Redis fails, queued events are dropped and a snapshot is
requested; once Redis answers again the worker re-registers from that snapshot (a RESYNCED event
with the whole set), so readers converge without replaying anything. Events drained after the
snapshot follow it in the queue, so order is kept.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import redis

from engine.block_pool import AllBlocksCleared, BlockRemoved, BlockStored
from proto.registry import CLEARED, REMOVED, STORED, WorkerRecord, WorkerRegistration, connect

logger = logging.getLogger(__name__)

_KINDS = {BlockStored: STORED, BlockRemoved: REMOVED, AllBlocksCleared: CLEARED}


class RegistryPublisher:
    def __init__(
        self, redis_url: str, record: WorkerRecord, *, ttl_s: float = 10.0, heartbeat_s: float = 1.0
    ) -> None:
        self.redis_url = redis_url
        self.record = record
        self.ttl_s = ttl_s
        self.heartbeat_s = heartbeat_s
        self.connected = False
        self.published = 0
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._want_snapshot = threading.Event()
        self._want_snapshot.set()  # the first registration carries the current cache
        self._load: dict[str, int] = {}
        self._next_load = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="registry-publisher", daemon=True)
        self._thread.start()

    def stop(self, deregister: bool = True) -> None:
        self._stop.set()
        self._queue.put(("stop", None))
        if self._thread is not None:
            self._thread.join(5)
        if deregister:
            try:
                WorkerRegistration(connect(self.redis_url), self.record).deregister()
            except redis.RedisError as exc:
                logger.warning("could not deregister %s: %s", self.record.worker_id, exc)

    # Engine thread ----------------------------------------------------------------------------

    def engine_tick(self, core) -> None:
        events = core.drain_kv_events()
        if self._want_snapshot.is_set():
            self._want_snapshot.clear()
            self._queue.put(("snapshot", core.kv.pool.cached_hashes()))
        elif events:
            self._queue.put(("events", events))
        now = time.monotonic()
        if now >= self._next_load:
            s = core.stats()
            self._load = {
                "num_running": s.num_running,
                "num_waiting": s.num_waiting,
                "num_free_blocks": s.num_free_blocks,
                "queued_prompt_tokens": core.pending_prompt_tokens(),
            }
            self._next_load = now + self.heartbeat_s / 2

    # Publisher thread -------------------------------------------------------------------------

    def _run(self) -> None:
        # NOTE: one registration for the whole incarnation: its sequence numbers must keep rising
        # across reconnects, or readers would take the new events for ones they already have.
        reg = WorkerRegistration(None, self.record, self.ttl_s)
        next_beat = 0.0
        awaiting_snapshot = True
        while not self._stop.is_set():
            try:
                kind, payload = self._queue.get(timeout=self.heartbeat_s / 2)
            except queue.Empty:
                kind, payload = "idle", None
            if kind == "stop":
                return
            try:
                if reg.client is None:
                    reg.client = connect(self.redis_url)
                if kind == "snapshot":
                    reg.register(payload)
                    awaiting_snapshot = False
                    self.connected = True
                elif kind == "events" and not awaiting_snapshot:
                    for kind_, hashes in _batches(payload):
                        reg.publish(kind_, hashes)
                        self.published += 1
                if not awaiting_snapshot and time.monotonic() >= next_beat:
                    reg.heartbeat(**self._load)
                    next_beat = time.monotonic() + self.heartbeat_s
            except redis.RedisError as exc:
                if self.connected:
                    logger.warning("registry unreachable (%s): will resync when it returns", exc)
                self.connected = False
                reg.client = None
                awaiting_snapshot = True
                self._want_snapshot.set()
                self._stop.wait(0.5)


def _batches(events: list) -> list[tuple[str, list[bytes]]]:
    """Consecutive events of one kind merged, order kept."""
    out: list[tuple[str, list[bytes]]] = []
    for ev in events:
        kind = _KINDS[type(ev)]
        hashes = [] if kind == CLEARED else list(ev.block_hashes)
        if out and out[-1][0] == kind and kind != CLEARED:
            out[-1][1].extend(hashes)
        else:
            out.append((kind, hashes))
    return out


def publish_worker(worker, address: str, redis_url: str) -> RegistryPublisher:
    """Register ``worker`` (a prefill or decode worker object) under ``address`` and publish its KV
    events from its engine loop; returns the running publisher (stop it with the worker)."""
    record = WorkerRecord(
        worker_id=worker.worker_id,
        role=worker.role,
        address=address,
        epoch=worker.epoch,
        model=worker.compat.model,
        block_size=worker.core.layout.block_size,
        num_blocks=worker.core.kv.num_blocks,
        cache_salt=worker.core.config.cache_salt,
    )
    publisher = RegistryPublisher(redis_url, record)
    publisher.start()
    worker.loop.add_tick(lambda: publisher.engine_tick(worker.core))
    return publisher
