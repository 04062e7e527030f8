"""A worker's side of the registry: its record registered and kept alive, its KV events published
with snapshots (``WorkerRegistration``), as transactions on owning its id; and ``net_events``, what
a transaction of several event batches writes. The keys and records are ``registry.schema``'s."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis

from registry.schema import (
    CLEARED,
    DISK_REMOVED,
    DISK_STORED,
    EVENTS_STREAM,
    HOST_REMOVED,
    HOST_STORED,
    LEFT_MARKER_TTL_MS,
    REMOVED,
    RESYNCED,
    STORED,
    STREAM_MAXLEN,
    WORKERS_SET,
    WorkerRecord,
    disk_snapshot_key,
    host_snapshot_key,
    left_key,
    pack_hashes,
    snapshot_key,
    snapshot_meta_key,
    snapshot_ttl_ms,
    worker_key,
)

logger = logging.getLogger(__name__)

# How long a confirmed ownership lets events skip the check (two round trips of three): a
# replacement registered within it (two live processes of one id) can get a stale write or two,
# which the stale one's next check stops; one stopped and continued checks at once.
OWNERSHIP_TRUST_S = 0.5


class SupersededError(RuntimeError):
    """A newer incarnation of this worker id owns its registry entries (a replacement started while
    this one was stopped or cut off): this one must write none of them again."""

    def __init__(self, worker_id: str, epoch: int, newer: int) -> None:
        super().__init__(f"worker {worker_id} (epoch {epoch}) was superseded by epoch {newer}")
        self.newer = newer


class WorkerRegistration:
    """A worker's side: register/heartbeat its record, and publish its KV events with snapshots.

    Every write is a transaction on the condition that this incarnation owns the worker id's entries:
    the snapshot meta's epoch, WATCHed, is its own (or, to register, none or an older one). An
    incarnation that comes back after its replacement registered (a process stopped, then
    continued) raises ``SupersededError`` instead of overwriting the replacement's record and
    snapshot every second, and leaves without deleting them. Events skip the check (one round trip,
    not three) for ``OWNERSHIP_TRUST_S`` after a check passed.

    Not thread-safe; one owner thread (the worker's publisher) calls it.
    """

    def __init__(self, client: redis.Redis | None, record: WorkerRecord, ttl_s: float = 10.0) -> None:
        self.client = client
        self.record = record
        self.ttl_ms = int(ttl_s * 1000)
        self.snapshot_ttl_ms = snapshot_ttl_ms(self.ttl_ms)
        self.seq = 0
        self._owned_until = 0.0  # (monotonic) until when events go out without checking the owner

    def register(
        self, cached_hashes: list[bytes], host_hashes: list[bytes] = (), disk_hashes: list[bytes] = ()
    ) -> None:
        """(Re)start this incarnation: record, fresh snapshot (every tier), and a CLEARED (nothing
        cached) or RESYNCED event for readers."""
        self._as_owner(lambda pipe: self._register(pipe, cached_hashes, host_hashes, disk_hashes), True)

    def _register(self, pipe, cached_hashes, host_hashes, disk_hashes) -> None:
        wid = self.record.worker_id
        self.seq += 1
        pipe.hset(worker_key(wid), mapping=self.record.to_fields())
        pipe.pexpire(worker_key(wid), self.ttl_ms)
        pipe.sadd(WORKERS_SET, wid)
        pipe.delete(snapshot_key(wid), host_snapshot_key(wid), disk_snapshot_key(wid), left_key(wid))
        if cached_hashes:
            pipe.sadd(snapshot_key(wid), *cached_hashes)
        if host_hashes:
            pipe.sadd(host_snapshot_key(wid), *host_hashes)
        if disk_hashes:
            pipe.sadd(disk_snapshot_key(wid), *disk_hashes)
        pipe.hset(snapshot_meta_key(wid), mapping={"epoch": self.record.epoch, "seq": self.seq})
        self._keep_snapshot(pipe)
        anything = cached_hashes or host_hashes or disk_hashes
        entry = self._entry(RESYNCED if anything else CLEARED, cached_hashes)
        if host_hashes:
            entry["x"] = pack_hashes(list(host_hashes))
        if disk_hashes:
            entry["y"] = pack_hashes(list(disk_hashes))
        pipe.xadd(EVENTS_STREAM, entry, maxlen=STREAM_MAXLEN, approximate=True)

    def _as_owner(self, write: Callable[[redis.client.Pipeline], None], registering: bool = False) -> bool:
        """``write(pipe)``'s commands in one transaction, if this incarnation owns the worker's entries
        (the meta's epoch is ours; ``registering``: or none, or an older one). False when the entries
        are gone or an older incarnation's (Redis restarted empty: register again, with a snapshot);
        ``SupersededError`` when a newer incarnation owns them."""
        meta, mine = snapshot_meta_key(self.record.worker_id), self.record.epoch
        seen = time.monotonic()
        for _ in range(3):  # a concurrent write to the meta: look again
            with self.client.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(meta)
                    stored = pipe.hget(meta, "epoch")
                    owner = int(stored) if stored is not None else None
                    if owner is not None and owner > mine:
                        raise SupersededError(self.record.worker_id, mine, owner)
                    if owner != mine and not registering:
                        return False
                    pipe.multi()
                    write(pipe)
                    pipe.execute()
                    self._owned_until = seen + OWNERSHIP_TRUST_S
                    return True
                except redis.WatchError:
                    continue
        raise redis.WatchError(f"the registry entries of {self.record.worker_id} kept changing")

    def heartbeat(self, **load: int) -> bool:
        """Refresh the record with the current load. False when Redis no longer knew this worker
        (restarted empty, or flushed, between two heartbeats): the caller must register again, with
        a snapshot, or readers would never list it nor know its cache."""
        for k, v in load.items():
            setattr(self.record, k, v)
        wid = self.record.worker_id
        key = worker_key(wid)

        def beat(pipe) -> None:
            pipe.hset(key, mapping=self.record.to_fields())
            pipe.pexpire(key, self.ttl_ms)
            self._keep_snapshot(pipe)

        # NOTE: checked before writing, under WATCH: a heartbeat that wrote first would list the
        # worker again with no snapshot (readers would take its cache for empty) until it registers.
        if not self._as_owner(beat):
            return False
        return not self.client.sadd(WORKERS_SET, wid)  # listed again (removed by hand): register

    def _keep_snapshot(self, pipe) -> None:
        """The snapshot's keys live ``snapshot_ttl_ms`` past this write: a worker that dies without
        deregistering leaves none behind (a set its events recreate gets it at the next heartbeat)."""
        wid = self.record.worker_id
        for key in (
            snapshot_meta_key(wid),
            snapshot_key(wid),
            host_snapshot_key(wid),
            disk_snapshot_key(wid),
        ):
            pipe.pexpire(key, self.snapshot_ttl_ms)

    def publish(self, kind: str, hashes: list[bytes]) -> int:
        """One batch of stored/removed block hashes, snapshot and stream updated atomically."""
        return self.publish_many([(kind, hashes)])

    def publish_many(self, batches: list[tuple[str, list[bytes]]]) -> int:
        """Batches of block events in order, in one transaction (one round trip, where a batch each
        cost one), as their net effect (``net_events``): at most a removal and a storing entry per
        tier between two clears, each entry its own sequence number. Returns the entries written."""
        merged = net_events(batches)
        if not merged:
            return 0
        seq = self.seq

        def events(pipe) -> None:
            self.seq = seq  # (a transaction tried again numbers its entries again)
            for kind, hashes in merged:
                self._add_event(pipe, kind, hashes)
            # The sequence only: the epoch is register's to write. Entries gone with a Redis
            # restarted empty are not recreated as ours (a partial snapshot would pass for the whole
            # one): the next heartbeat finds no owner and registers again with the whole cache.
            pipe.hset(snapshot_meta_key(self.record.worker_id), "seq", self.seq)

        if time.monotonic() < self._owned_until:  # ownership seen lately: one round trip
            pipe = self.client.pipeline(transaction=True)
            events(pipe)
            pipe.execute()
            return len(merged)
        return len(merged) if self._as_owner(events) else 0

    def _add_event(self, pipe, kind: str, hashes: list[bytes]) -> None:
        wid = self.record.worker_id
        self.seq += 1
        if kind == STORED:
            pipe.sadd(snapshot_key(wid), *hashes)
        elif kind == REMOVED:
            pipe.srem(snapshot_key(wid), *hashes)
        elif kind == HOST_STORED:
            pipe.sadd(host_snapshot_key(wid), *hashes)
        elif kind == HOST_REMOVED:
            pipe.srem(host_snapshot_key(wid), *hashes)
        elif kind == DISK_STORED:
            pipe.sadd(disk_snapshot_key(wid), *hashes)
        elif kind == DISK_REMOVED:
            pipe.srem(disk_snapshot_key(wid), *hashes)
        else:
            pipe.delete(snapshot_key(wid), host_snapshot_key(wid), disk_snapshot_key(wid))
        pipe.xadd(EVENTS_STREAM, self._entry(kind, hashes), maxlen=STREAM_MAXLEN, approximate=True)

    def deregister(self) -> None:
        """Leave on purpose: the record goes, and a ``left`` marker tells readers not to wait out the
        grace period they give a worker whose record merely vanished (a Redis restarted empty)."""
        wid = self.record.worker_id

        def leave(pipe) -> None:
            pipe.delete(
                worker_key(wid),
                snapshot_key(wid),
                host_snapshot_key(wid),
                disk_snapshot_key(wid),
                snapshot_meta_key(wid),
            )
            pipe.srem(WORKERS_SET, wid)
            pipe.set(left_key(wid), self.record.epoch, px=LEFT_MARKER_TTL_MS)

        try:
            self._as_owner(leave, registering=True)  # ours, or nobody's (gone with Redis): leave
        except SupersededError:  # a newer incarnation's entries: not ours to delete
            logger.info("%s: a newer incarnation owns its registry entries; leaving them", wid)

    def _entry(self, kind: str, hashes: list[bytes]) -> dict[str, bytes | str | int]:
        r = self.record
        return {"w": r.worker_id, "e": r.epoch, "s": self.seq, "k": kind, "h": pack_hashes(hashes)}


# Each stored/removed kind: its tier and whether it stores; and each tier's two kinds, removal first.
_TIER_OF = {
    STORED: (0, True),
    REMOVED: (0, False),
    HOST_STORED: (1, True),
    HOST_REMOVED: (1, False),
    DISK_STORED: (2, True),
    DISK_REMOVED: (2, False),
}
_TIER_KINDS = ((REMOVED, STORED), (HOST_REMOVED, HOST_STORED), (DISK_REMOVED, DISK_STORED))


def net_events(batches: list[tuple[str, list[bytes]]]) -> list[tuple[str, list[bytes]]]:
    """Block events as their net effect: between two clears, per tier, the hashes whose last event
    removed them, then those whose last event stored them. A reader (a set per worker and tier)
    ends in the same state as after the events one by one. A prefill worker's events alternate
    (each prompt evicts a block, then stores its own), so merging only adjacent batches of a kind
    left ~10 entries in a 10 ms transaction under short requests: 23 commands, ~0.3 ms of the
    publisher's CPU, and an entry each for every router to parse."""
    out: list[tuple[str, list[bytes]]] = []
    last: list[dict[bytes, bool]] = [{}, {}, {}]  # per tier: hash -> stored by its last event

    def flush() -> None:
        for tier, kinds in enumerate(_TIER_KINDS):
            acts = last[tier]
            for kind, stored in zip(kinds, (False, True)):
                hashes = [h for h, s in acts.items() if s is stored]
                if hashes:
                    out.append((kind, hashes))
            acts.clear()

    for kind, hashes in batches:
        tier = _TIER_OF.get(kind)
        if tier is None:  # a clear (or a kind this code does not merge): a barrier, kept in place
            flush()
            out.append((kind, list(hashes)))
            continue
        acts, stored = last[tier[0]], tier[1]
        for h in hashes:
            acts[h] = stored
    flush()
    return out
