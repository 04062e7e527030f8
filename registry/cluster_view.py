"""The router's view of the cluster, kept current from Redis by a background thread.

Lifecycle: ``start()`` -> the thread (1) notes the event stream's tail, (2) reads every live worker's
record and snapshot into the ``PrefixIndex``, then (3) follows the stream (XREAD, blocking briefly),
applying events and resynchronising a worker from its snapshot whenever ``apply`` reports a gap;
every ``poll_s`` it re-reads the worker records (load, liveness) and drops a worker once its record
has been gone for ``grace_s`` (a Redis restarted empty lists nobody until the workers re-register:
that is an outage, not a cluster without workers). Any Redis error marks the view ``degraded``: routing goes on from the last known index and
worker table, and when Redis answers again the thread starts over at (1), catching up. Routing
never waits on Redis.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from registry.prefix_index import PrefixIndex
from registry.schema import (
    DRAINING_KEY,
    EVENTS_STREAM,
    KVEventRecord,
    WorkerRecord,
    connect,
    read_departed,
    read_snapshot,
    read_workers,
)

logger = logging.getLogger(__name__)


class ClusterView:
    def __init__(
        self, redis_url: str, *, poll_s: float = 0.5, block_ms: int = 100, grace_s: float = 10.0
    ) -> None:
        self.redis_url = redis_url
        self.grace_s = grace_s
        self._missing_since: dict[str, float] = {}
        self._beats: dict[str, tuple[int, float]] = {}  # worker -> (its last beat, when it rose)
        self.poll_s = poll_s
        self.block_ms = block_ms
        self.index = PrefixIndex()
        self.workers: dict[str, WorkerRecord] = {}
        self.degraded = True  # until the first successful sync
        self.draining = False  # the application is shutting down: take no new requests
        self.events_applied = 0
        self.resyncs = 0
        self.event_lag_s = 0.0
        self.last_sync = 0.0
        self.last_id = b"0-0"  # position in the event stream
        self._stop = threading.Event()
        self._synced = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: redis.Redis | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="cluster-view", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def wait_synced(self, timeout: float = 10.0) -> bool:
        return self._synced.wait(timeout)

    def live_workers(self, role: str | None = None) -> list[WorkerRecord]:
        return [w for w in list(self.workers.values()) if role is None or w.role == role]

    def step_s_of(self, worker_id: str) -> float:
        """``worker_id``'s step budget as its last heartbeat carried it (0 when unknown): the
        longest recent step, or what the running one should take if longer."""
        rec = self.workers.get(worker_id)
        return rec.step_ms / 1000 if rec is not None else 0.0

    def silent_for(self, worker_id: str) -> float:
        """Seconds ``worker_id`` has shown no sign of life: its heartbeats stopped rising (a stopped
        or cut-off process) or its engine thread stopped reporting its load (a hung engine). 0 while
        Redis is out of reach or the worker unknown: then nobody can be judged."""
        rec, seen = self.workers.get(worker_id), self._beats.get(worker_id)
        if self.degraded or rec is None or seen is None:
            return 0.0
        return max(time.monotonic() - seen[1], rec.load_age_ms / 1000)

    # The thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                self._client = self._client or connect(self.redis_url)
                last_id = self._full_sync()
                self.degraded = False
                backoff = 0.1
                self._follow(last_id)
            except redis.RedisError as exc:
                if not self.degraded:
                    logger.warning("Redis unreachable (%s): routing on the last known cluster state", exc)
                self.degraded = True
                self._synced.clear()
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 2.0)
            except Exception:  # a malformed entry must not kill the view: resync from scratch
                logger.exception("cluster view failed; resynchronising")
                self.degraded = True
                self._synced.clear()
                self._stop.wait(backoff)

    def _full_sync(self) -> bytes:
        client = self._client
        tail = client.xrevrange(EVENTS_STREAM, count=1)
        last_id = tail[0][0] if tail else b"0-0"
        self._refresh_workers()
        for wid in list(self.workers):
            self._resync(wid)
        self._synced.set()
        return last_id

    def _follow(self, last_id: bytes) -> None:
        client = self._client
        next_poll = time.monotonic() + self.poll_s
        while not self._stop.is_set():
            batches = client.xread({EVENTS_STREAM: last_id}, count=1000, block=self.block_ms)
            for _stream, entries in batches or ():
                for entry_id, fields in entries:
                    last_id = self.last_id = entry_id
                    self._apply(KVEventRecord.from_fields(fields))
                if entries:
                    ms = int(entries[-1][0].split(b"-")[0])
                    self.event_lag_s = max(0.0, time.time() - ms / 1000)
            if time.monotonic() >= next_poll:
                self._refresh_workers()
                next_poll = time.monotonic() + self.poll_s

    def _apply(self, ev: KVEventRecord) -> None:
        with self.index.lock:
            ok = self.index.apply(ev)
        self.events_applied += 1
        if not ok:
            logger.info("gap in %s's KV events (seq %d): resynchronising", ev.worker_id, ev.seq)
            self._resync(ev.worker_id)

    def _resync(self, worker_id: str) -> None:
        epoch, seq, hashes, host, disk = read_snapshot(self._client, worker_id)
        with self.index.lock:
            if epoch != 0:
                self.index.replace(worker_id, epoch, seq, hashes, host, disk)
            elif worker_id not in self._missing_since:
                self.index.drop(worker_id)
            # else: missing from a Redis that lost its data; keep the last known entries for now
        self.resyncs += 1

    def _refresh_workers(self) -> None:
        self.draining = bool(self._client.exists(DRAINING_KEY))
        live = read_workers(self._client, prune=True)
        now = time.monotonic()
        for wid in live:
            self._missing_since.pop(wid, None)
        missing = sorted(set(self.workers) - set(live))
        departed = read_departed(self._client, missing)
        for wid in missing:
            since = self._missing_since.setdefault(wid, now)
            if wid not in departed and now - since < self.grace_s:
                live[wid] = self.workers[wid]  # not gone yet: Redis may have restarted empty
                self._beats[wid] = (self.workers[wid].beat, now)  # unknown, not silent
                continue
            logger.info(
                "worker %s left (%s)", wid, "deregistered" if wid in departed else "its registration is gone"
            )
            del self._missing_since[wid]
            self._beats.pop(wid, None)
            with self.index.lock:
                self.index.drop(wid)
        for wid, rec in live.items():
            seen = self._beats.get(wid)
            if seen is None or seen[0] != rec.beat:
                self._beats[wid] = (rec.beat, now)
            known = self.index.epoch_of(wid)
            if known is not None and rec.epoch > known:
                self._resync(wid)  # restarted: its old incarnation's blocks are gone
        self.workers = live
        self.last_sync = time.time()
