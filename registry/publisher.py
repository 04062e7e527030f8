"""A worker's link to the registry: register, heartbeat its load, publish its KV events in order.

The worker's engine thread hands batches of block events (``offer_events``), its prefix cache when
a snapshot is wanted (``snapshot_wanted`` / ``offer_snapshot``) and its load (``offer_load``) to a
queue, never touching Redis itself. A publisher thread drains the queue into Redis: the event
batches it finds queued together go out in one transaction as their net effect (per tier, the
blocks whose last event removed them, then those whose last event stored them; a clear stays a
barrier: ``registration.net_events``), a stream entry each (a busy engine offers one or two batches every
step; a transaction each kept a decode worker's publisher thread at ~6% of its process under short
requests). Event transactions
are at least ``PUBLISH_INTERVAL_S`` apart: what arrives meanwhile waits for the next one (a prefill
worker under short requests made a transaction per prompt, a fifth of its samples in a py-spy
``--gil`` profile on 2 busy cores; the router read an entry for each). Readers see a block at most
that much later. When Redis fails, or a heartbeat finds that Redis
lost the worker's registration (restarted empty between two heartbeats, the connection never
failing), queued events are dropped and a snapshot is requested; once Redis answers again the worker re-registers from that snapshot (a RESYNCED event
with the whole set), so readers converge without replaying anything. Events drained after the
snapshot follow it in the queue, so order is kept. A newer incarnation of the same worker id
(``SupersededError``) ends the thread: this worker stays out of the registry, and its leaving
deletes nothing of its replacement's.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import redis

from registry.registration import SupersededError, WorkerRegistration
from registry.schema import WorkerRecord, connect

logger = logging.getLogger(__name__)

PUBLISH_INTERVAL_S = 0.01  # the least time between two transactions of events


class RegistryPublisher:
    def __init__(
        self, redis_url: str, record: WorkerRecord, *, ttl_s: float = 10.0, heartbeat_s: float = 1.0
    ) -> None:
        self.redis_url = redis_url
        self.record = record
        self.ttl_s = ttl_s
        self.heartbeat_s = heartbeat_s
        self.connected = False
        self.superseded: int | None = None  # the newer incarnation's epoch, once one took the id over
        self.published = 0
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._want_snapshot = threading.Event()
        self._want_snapshot.set()  # the first registration carries the current cache
        self._load: dict[str, int] = {}
        self._next_load = 0.0
        self._load_at = time.monotonic()  # when the engine thread last reported its load
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._published_at = 0.0  # when the last events went out (monotonic)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="registry-publisher", daemon=True)
        self._thread.start()

    def stop(self, deregister: bool = True) -> None:
        self._stop.set()
        self._queue.put(("stop", None))
        if self._thread is not None:
            self._thread.join(5)
        if deregister:
            client = connect(self.redis_url)
            try:
                WorkerRegistration(client, self.record).deregister()
            except redis.RedisError as exc:
                logger.warning("could not deregister %s: %s", self.record.worker_id, exc)
            finally:
                client.close()

    # Worker's engine thread ------------------------------------------------------------------

    def snapshot_wanted(self) -> bool:
        """True once after a (re)connect: the next offer must be the whole cache (``offer_snapshot``)."""
        if self._want_snapshot.is_set():
            self._want_snapshot.clear()
            return True
        return False

    def offer_snapshot(
        self, cached_hashes: list[bytes], host_hashes: list[bytes] = (), disk_hashes: list[bytes] = ()
    ) -> None:
        """The whole prefix cache: the KV pool's hashes, the host tier's and the disk tier's."""
        self._queue.put(("snapshot", (cached_hashes, host_hashes, disk_hashes)))

    def offer_events(self, batches: list[tuple[str, list[bytes]]]) -> None:
        """Block events as ``(kind, hashes)`` batches in order (kinds ``STORED``/``REMOVED``/``CLEARED``)."""
        if batches:
            self._queue.put(("events", batches))

    def load_due(self) -> bool:
        return time.monotonic() >= self._next_load

    def offer_load(self, **load: int) -> None:
        """The worker's load fields of its record (sent with the next heartbeat)."""
        self._load = dict(load)
        self._load_at = time.monotonic()
        self._next_load = self._load_at + self.heartbeat_s / 2

    # Publisher thread -------------------------------------------------------------------------

    def _run(self) -> None:
        # NOTE: one registration for the whole incarnation: its sequence numbers must keep rising
        # across reconnects, or readers would take the new events for ones they already have.
        reg = WorkerRegistration(None, self.record, self.ttl_s)
        next_beat = 0.0
        awaiting_snapshot = True
        held: tuple[str, Any] | None = None  # taken from the queue behind events, handled next
        while not self._stop.is_set():
            if held is not None:
                (kind, payload), held = held, None
            else:
                try:
                    kind, payload = self._queue.get(timeout=self.heartbeat_s / 2)
                except queue.Empty:
                    kind, payload = "idle", None
            if kind == "events":  # and every batch queued behind it: one transaction for all
                payload = list(payload)
                wait = self._published_at + PUBLISH_INTERVAL_S - time.monotonic()
                if wait > 0:  # the last transaction was recent: gather more first
                    self._stop.wait(wait)
                while held is None:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item[0] == "events":
                        payload.extend(item[1])
                    else:
                        held = item
            if kind == "stop" or self._stop.is_set():
                return  # NOTE: never register again once stopping (stop() deregisters)
            try:
                if reg.client is None:
                    reg.client = connect(self.redis_url)
                if kind == "snapshot":
                    reg.register(*payload)
                    awaiting_snapshot = False
                    self.connected = True
                elif kind == "events" and not awaiting_snapshot:
                    self.published += reg.publish_many(payload)
                    self._published_at = time.monotonic()
                if not awaiting_snapshot and time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + self.heartbeat_s
                    age_ms = int((time.monotonic() - self._load_at) * 1000)
                    if not reg.heartbeat(**self._load, beat=self.record.beat + 1, load_age_ms=age_ms):
                        logger.warning(
                            "the registry lost this worker (Redis restarted empty?): registering again"
                        )
                        awaiting_snapshot = True
                        self._want_snapshot.set()
            except SupersededError as exc:  # its replacement's entries: write them no more
                logger.error("%s: leaving the registry to the newer incarnation", exc)
                self.superseded = exc.newer
                self.connected = False
                return
            except redis.RedisError as exc:
                if self.connected:
                    logger.warning("registry unreachable (%s): will resync when it returns", exc)
                self.connected = False
                reg.client = None
                awaiting_snapshot = True
                self._want_snapshot.set()
                self._stop.wait(0.5)
