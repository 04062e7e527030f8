"""The router's in-process replica of the global prefix index: block hash -> workers holding it,
in their KV pool (device), in their host tier or in their disk tier.

Fed by the workers' KV events (``registry.schema``). Per worker it tracks the incarnation (epoch)
and the last applied sequence number: an event that skips a number, or a new incarnation that does
not start at 1 with CLEARED/RESYNCED, makes ``apply`` return False and the caller resynchronises
that worker from its snapshot (``replace``). Events a snapshot already covers are skipped, and
events of an older incarnation are ignored. Routing reads it under a lock, never touching Redis.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable, Mapping

from registry.schema import (
    CLEARED,
    DISK_REMOVED,
    DISK_STORED,
    HOST_REMOVED,
    HOST_STORED,
    REMOVED,
    RESYNCED,
    STORED,
    KVEventRecord,
)


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[bytes, set[str]] = {}
        self._blocks: dict[str, set[bytes]] = {}
        self._host = PrefixIndex._Tier()  # the host tiers' blocks, kept apart
        self._disk = PrefixIndex._Tier()  # the disk tiers' blocks, the same
        self._epoch: dict[str, int] = {}
        self._seq: dict[str, int] = {}
        self.lock = threading.Lock()
        self.gaps_detected = 0

    # Updates (the cluster view's thread) -------------------------------------------------------

    def apply(self, ev: KVEventRecord) -> bool:
        """Apply one event; False when the worker must be resynchronised from its snapshot."""
        w = ev.worker_id
        known = self._epoch.get(w)
        if known is not None and ev.epoch < known:
            return True  # a previous incarnation's late event
        if known is None or ev.epoch > known:
            self._drop(w)
            self._epoch[w] = ev.epoch
            self._seq[w] = 0
            if ev.seq != 1 or ev.kind not in (CLEARED, RESYNCED):
                self.gaps_detected += 1
                return False
        elif ev.seq <= self._seq[w]:
            return True  # already in the snapshot we resynchronised from
        elif ev.seq != self._seq[w] + 1:
            self.gaps_detected += 1
            return False
        if ev.kind == STORED:
            self._add(w, ev.hashes)
        elif ev.kind == REMOVED:
            self._remove(w, ev.hashes)
        elif ev.kind == HOST_STORED:
            self._host.add(w, ev.hashes)
        elif ev.kind == HOST_REMOVED:
            self._host.remove(w, ev.hashes)
        elif ev.kind == DISK_STORED:
            self._disk.add(w, ev.hashes)
        elif ev.kind == DISK_REMOVED:
            self._disk.remove(w, ev.hashes)
        elif ev.kind in (CLEARED, RESYNCED):  # the event carries the whole set (every tier)
            self._drop(w)
            self._add(w, ev.hashes)
            self._host.add(w, ev.host_hashes)
            self._disk.add(w, ev.disk_hashes)
        # else: a kind of a newer worker (a tier this router does not know): its sequence still counts
        self._seq[w] = ev.seq
        return True

    def replace(
        self,
        worker_id: str,
        epoch: int,
        seq: int,
        hashes: Iterable[bytes],
        host: Iterable[bytes] = (),
        disk: Iterable[bytes] = (),
    ) -> None:
        """Resynchronise one worker from its snapshot (state after its events 1..seq)."""
        self._drop(worker_id)
        self._epoch[worker_id] = epoch
        self._seq[worker_id] = seq
        self._add(worker_id, hashes)
        self._host.add(worker_id, host)
        self._disk.add(worker_id, disk)

    def drop(self, worker_id: str) -> None:
        self._drop(worker_id)
        self._epoch.pop(worker_id, None)
        self._seq.pop(worker_id, None)

    # Queries (routing) ------------------------------------------------------------------------

    def match(
        self,
        hashes: Iterable[bytes],
        workers: Iterable[str],
        also: Mapping[bytes, Collection[str]] | None = None,
    ) -> dict[str, int]:
        """For each worker: how many leading blocks of ``hashes`` it holds. ``hashes`` may be lazy:
        it is consumed only up to the first block none of ``workers`` holds. ``also`` adds holders
        the caller knows of that the index does not show yet (a router's routed prefixes)."""
        holders = self._holders
        alive = set(workers)
        lengths = dict.fromkeys(alive, 0)
        depth = 0
        for h in hashes:
            held = holders.get(h)
            if also:
                extra = also.get(h)
                if extra:
                    held = held.union(extra) if held else set(extra)
            if not held:
                break
            if not alive <= held:  # someone's prefix ends here: record it, go on with the rest
                for w in alive - held:
                    lengths[w] = depth
                alive &= held
                if not alive:
                    break
            depth += 1
        for w in alive:
            lengths[w] = depth
        return lengths

    def match_tiers(
        self,
        hashes: Iterable[bytes],
        workers: Iterable[str],
        also: Mapping[bytes, Collection[str]] | None = None,
    ) -> dict[str, tuple[int, int, int]]:
        """For each worker: (leading blocks of ``hashes`` in its KV pool, blocks after those in its
        host tier, blocks after those in its disk tier), the runs a request's prefix hit there would
        take, as the engine walks them (``KVCacheManager.find_prefix_hit``; ``match``'s rules)."""
        holders, host, disk = self._holders, self._host.holders, self._disk.holders
        if not host and not disk:  # no tier under any device: the device run alone, by the set walk
            return {w: (n, 0, 0) for w, n in self.match(hashes, workers, also).items()}
        run = dict.fromkeys(workers, 0)  # the tier each worker's hit has reached: device, host, disk
        lengths = {w: [0, 0, 0] for w in run}
        live = set(run)
        for h in hashes:
            held = holders.get(h, ())
            if also:
                extra = also.get(h)
                if extra:
                    held = set(held).union(extra)
            tiers = (held, host.get(h, ()), disk.get(h, ()))
            for w in list(live):
                t = run[w]
                while t < 3 and w not in tiers[t]:
                    t += 1
                if t == 3:
                    live.discard(w)
                else:
                    run[w] = t
                    lengths[w][t] += 1
            if not live:
                break
        return {w: (d, t, k) for w, (d, t, k) in lengths.items()}

    def num_host_blocks_of(self, worker_id: str) -> int:
        return len(self._host.blocks.get(worker_id, ()))

    def num_disk_blocks_of(self, worker_id: str) -> int:
        return len(self._disk.blocks.get(worker_id, ()))

    def num_blocks_of(self, worker_id: str) -> int:
        return len(self._blocks.get(worker_id, ()))

    def blocks_of(self, worker_id: str) -> set[bytes]:
        return set(self._blocks.get(worker_id, ()))

    def epoch_of(self, worker_id: str) -> int | None:
        return self._epoch.get(worker_id)

    def workers(self) -> list[str]:
        return list(self._epoch)

    @property
    def size(self) -> int:
        """Indexed (block, worker) entries, every tier."""
        lower = (t.blocks.values() for t in (self._host, self._disk))
        return sum(len(b) for b in self._blocks.values()) + sum(len(b) for blocks in lower for b in blocks)

    # Internals --------------------------------------------------------------------------------

    def _add(self, w: str, hashes: Iterable[bytes]) -> None:
        mine = self._blocks.setdefault(w, set())
        for h in hashes:
            if h not in mine:
                mine.add(h)
                self._holders.setdefault(h, set()).add(w)

    def _remove(self, w: str, hashes: Iterable[bytes]) -> None:
        mine = self._blocks.get(w)
        if not mine:
            return
        for h in hashes:
            if h in mine:
                mine.discard(h)
                held = self._holders.get(h)
                if held is not None:
                    held.discard(w)
                    if not held:
                        del self._holders[h]

    def _drop(self, w: str) -> None:
        mine = self._blocks.pop(w, None)
        if mine:
            self._remove_all(w, mine)
        self._host.drop(w)
        self._disk.drop(w)

    class _Tier:
        """One more tier's block -> holders map (the host tiers, the disk tiers): add, remove, drop."""

        def __init__(self) -> None:
            self.holders: dict[bytes, set[str]] = {}
            self.blocks: dict[str, set[bytes]] = {}

        def add(self, w: str, hashes: Iterable[bytes]) -> None:
            mine = self.blocks.setdefault(w, set())
            for h in hashes:
                if h not in mine:
                    mine.add(h)
                    self.holders.setdefault(h, set()).add(w)

        def remove(self, w: str, hashes: Iterable[bytes]) -> None:
            mine = self.blocks.get(w)
            if not mine:
                return
            for h in hashes:
                if h in mine:
                    mine.discard(h)
                    held = self.holders[h]
                    held.discard(w)
                    if not held:
                        del self.holders[h]

        def drop(self, w: str) -> None:
            for h in self.blocks.pop(w, ()):
                held = self.holders[h]
                held.discard(w)
                if not held:
                    del self.holders[h]

    def _remove_all(self, w: str, hashes: set[bytes]) -> None:
        for h in hashes:
            held = self._holders.get(h)
            if held is not None:
                held.discard(w)
                if not held:
                    del self._holders[h]
