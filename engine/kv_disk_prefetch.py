"""Disk-tier prefixes read ahead of admission, off the engine's thread (issue 33).

Read at admission, a prompt's disk-tier blocks were read inside the step that admitted it: every
running sequence waited for the disk (a 2 MiB block is ~1 ms from the page cache, more from the
device itself). Now ``EngineCore.add_request`` *stages* a request whose prefix continues into the
disk tier: its disk slots are pinned (no write reuses them), a host-tier slot is reserved for each
block, and the disk tier's reader thread reads the records into those slots (hash and CRC checked;
a record whose write has not landed comes from its queued copy) while steps go on. Each step first
takes the staged requests whose reads are over: the blocks that checked out are published in the
host tier (kept pinned there until the request has been admitted, so the steps in between cannot
evict them), the others dropped from the disk tier (their tokens are computed), and the request
joins the waiting queue, whose admission finds the prefix in the host tier (a copy). Hit statistics
still count those blocks as disk hits (``Request.read_ahead``).

Read-ahead holds at most half the host tier's slots for requests not admitted yet (each such slot
evicted a host-tier block a waiting request may have hit). What stays synchronous: the disk blocks
past that budget, a request staged when the budget is spent or no host slot can be freed; those are
read at admission as before. An aborted staged request leaves at once; its reads finish and publish
their blocks like any others.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.block_hash import BlockHash
from engine.kv_disk_tier import ReadAhead

if TYPE_CHECKING:
    from engine.kv_cache_manager import KVCacheManager
    from engine.request import Request

logger = logging.getLogger(__name__)
# At most this share of the host tier's slots holds blocks read ahead for requests not admitted yet:
# each such slot evicts a host-tier block that a waiting request may have hit. (A quarter read 0.49x
# the blocks ahead of half in bench.kv_tiers' overflowing run, at the same TTFT.)
READ_AHEAD_SHARE = 0.5


@dataclass(eq=False, slots=True)
class _Staged:
    req: Request
    disk_slots: list[int]
    hashes: list[BlockHash]
    host_slots: list[int]
    job: ReadAhead
    aborted: bool = False


class DiskPrefetch:
    """The staged requests of one engine (engine thread only)."""

    def __init__(self, kv: KVCacheManager, share: float = READ_AHEAD_SHARE) -> None:
        self.kv = kv
        self.budget = max(1, int(kv.host_tier.num_slots * share))  # host slots read-ahead may hold
        # Reads in flight, in the order staged (an aborted request's stay until they land, beside a
        # new request of the same id).
        self._staged: list[_Staged] = []
        # Blocks read ahead for requests not admitted yet, kept pinned in the host tier until then
        # (else the evictions of the steps in between may drop them and the admission reads again).
        self._held: list[tuple[Request, list[int]]] = []
        self.read_ahead_blocks = 0  # blocks published in the host tier by reads ahead

    def __contains__(self, request_id: str) -> bool:
        return self._live(request_id) is not None

    def requests(self) -> list[Request]:
        return [st.req for st in self._staged if not st.aborted]

    def busy(self) -> bool:
        """Whether reads are in flight (a staged request waits for them, or an aborted one's land)."""
        return bool(self._staged)

    def active(self) -> bool:
        """Whether ``ready`` has anything to do: reads in flight, or blocks held for an admission."""
        return bool(self._staged or self._held)

    def stage(self, req: Request) -> bool:
        """Start reading ``req``'s disk-tier prefix blocks into the host tier; False (nothing
        started) when its prefix does not reach the disk tier or no host slot can take a block."""
        kv = self.kv
        hit = kv.find_prefix_hit(req)
        if not hit.disk_slots:
            return False
        room = self.budget - sum(len(st.host_slots) for st in self._staged)
        room -= sum(len(slots) for _, slots in self._held)
        if room <= 0:
            return False
        first = len(hit.block_ids) + len(hit.host_slots)
        disk_slots = list(hit.disk_slots[:room])  # the rest, if any, is read at admission
        kv.disk_tier.pin(disk_slots)  # the reservations' evictions write to other slots
        kv.host_tier.pin(hit.host_slots)  # and keep the prefix in front of these blocks
        host_slots: list[int] = []
        try:
            for _ in disk_slots:
                slot = kv.host_tier.reserve()
                if slot is None:
                    break
                host_slots.append(slot)
        finally:
            kv.host_tier.unpin(hit.host_slots)
        kv.disk_tier.unpin(disk_slots[len(host_slots) :])
        if not host_slots:
            return False
        disk_slots = disk_slots[: len(host_slots)]
        hashes = req.block_hashes[first : first + len(host_slots)]
        rows = kv.host_blocks.rows
        kv.host_blocks.settle()  # a reserved row may still be on its way from the device (evicted)
        job = kv.disk_blocks.read_ahead([(d, h, rows[s]) for d, h, s in zip(disk_slots, hashes, host_slots)])
        self._staged.append(_Staged(req, disk_slots, hashes, host_slots, job))
        return True

    def abort(self, request_id: str) -> Request | None:
        """Take a staged request out (its reads go on and land as any others)."""
        st = self._live(request_id)
        if st is None:
            return None
        st.aborted = True
        return st.req

    def _live(self, request_id: str) -> _Staged | None:
        return next((st for st in self._staged if st.req.request_id == request_id and not st.aborted), None)

    def ready(self) -> list[Request]:
        """The staged requests whose reads are over, their blocks published (in the order staged).
        Blocks held for requests admitted since the last call (or gone) are unpinned first."""
        if self._held:
            held = []
            for req, slots in self._held:
                if req.num_cached_tokens == -1 and not req.status.finished:  # not admitted yet
                    held.append((req, slots))
                else:
                    self.kv.host_tier.unpin(slots)
            self._held = held
        out = []
        for st in [st for st in self._staged if st.job.done.is_set()]:
            self._staged.remove(st)
            self._publish(st)
            if not st.aborted:
                out.append(st.req)
        return out

    def wait(self, timeout_s: float) -> None:
        """Until the first staged request's reads are over (or ``timeout_s``): a step with nothing
        else to do waits here instead of spinning."""
        if self._staged:
            self._staged[0].job.done.wait(timeout_s)

    def _publish(self, st: _Staged) -> None:
        kv = self.kv
        kv.disk_tier.unpin(st.disk_slots)
        good: list[BlockHash] = []
        kept: list[int] = []
        for h, slot, ok in zip(st.hashes, st.host_slots, st.job.results):
            if ok:  # (False from commit: the block came back by another way meanwhile; slot freed)
                if kv.host_tier.commit(h, slot, received=False):
                    good.append(h)
                    kept.append(slot)
                continue
            kv.host_tier.release(slot)  # not the block the tier says: dropped, its tokens computed
            logger.error("disk tier: slot of block %s does not hold it: recomputing it", h.hex())
            kv.disk_tier.counters.rejected_blocks += 1
            kv.disk_tier.discard(h)
        if kept and not st.aborted:
            kv.host_tier.pin(kept)
            self._held.append((st.req, kept))
        if good:
            kv.disk_tier.loaded(good)
            self.read_ahead_blocks += len(good)
            st.req.read_ahead = st.req.read_ahead | frozenset(good)
