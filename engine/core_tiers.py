"""The engine's prefix-cache tiers: a mixin of ``engine.engine_core.EngineCore``.

Their block events and snapshot for the registry, the cost of a hit in each tier for the router's
model (measured load times over measured prefill time), and the requests whose disk-tier prefix is
read ahead of their admission (``engine.kv_disk_prefetch``): staged when added, handed to the
scheduler at the start of the step after their reads are over.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.kv_disk_prefetch import DiskPrefetch

if TYPE_CHECKING:
    from engine.block_pool import KVEvent
    from engine.kv_cache_manager import KVCacheManager
    from engine.request import Request
    from engine.scheduler import Scheduler

STAGED_WAIT_S = 0.002  # a step with only staged requests waits this long for their reads
# Before its first measured read of a peer's blocks, a worker assumes one costs at least this share
# of computing them: a read's fixed costs (the Lend call, a step on each side) dwarf its bytes, and
# an optimistic guess would route reads that lose to computing until the first measure lands.
PEER_READ_PRIOR = 0.5


class TierMixin:
    kv: KVCacheManager
    scheduler: Scheduler
    prefetch: DiskPrefetch | None
    _prefill_s_per_token: float | None

    def _stage(self, req: Request) -> bool:
        """Whether ``req`` waits for its disk-tier prefix read ahead (else it goes to the scheduler)."""
        return self.prefetch is not None and self.prefetch.stage(req)

    def _admit_staged(self) -> None:
        """The staged requests whose reads are over join the waiting queue. With nothing else to do,
        wait a moment for a read first (a step must not spin)."""
        p = self.prefetch
        if p is None or not p.active():
            return
        if p.busy() and not self.scheduler.has_work() and not self._inflight:
            p.wait(STAGED_WAIT_S)
        for req in p.ready():
            self.scheduler.add(req)

    def drain_kv_events(self) -> list[KVEvent]:
        """The prefix cache's block events since the last call: the device pool's, then the host
        tier's, then the disk tier's (each tier's in order; the tiers are independent sets). The
        first call subscribes: an engine nobody reads the events of keeps none (an offline run would
        hold every one), so a subscriber takes a snapshot (``cached_hashes``) for what came before."""
        tiers = [self.kv.pool, self.kv.host_tier, self.kv.disk_tier]
        events: list[KVEvent] = []
        for tier in (t for t in tiers if t is not None):
            events += tier.drain_events()
            tier.recording = True
        return events

    def host_hit_cost_pct(self) -> int:
        """A host-tier hit's cost in % of computing the block (measured load time over a block's
        measured prefill time; 100 without either). Disk: its read time. Peer: the read's measured
        time (``peer_tiers``: the Lend call and the READ, recent reads weighing most; before one,
        ``PEER_READ_PRIOR`` of computing the block) plus the host load after it; 100 when this
        engine reads no peer's blocks."""
        return self._load_cost_pct(self.kv.host_blocks)

    def disk_hit_cost_pct(self) -> int:
        return self._load_cost_pct(self.kv.disk_blocks)

    def peer_hit_cost_pct(self) -> int:
        h = self.kv.host_blocks
        if h is None or not h.peer_reads or not self._prefill_s_per_token:
            return 100
        read_s = h.peer_read_s_per_block
        if read_s is None:
            read_s = PEER_READ_PRIOR * self._prefill_s_per_token * self.kv.block_size
        return self._load_cost_pct(h, read_s)

    def _load_cost_pct(self, blocks, extra_s: float = 0.0) -> int:
        if blocks is None or blocks.load_s_per_block is None or not self._prefill_s_per_token:
            return 100
        block_s = self._prefill_s_per_token * self.kv.block_size
        return max(0, min(100, round(100 * (blocks.load_s_per_block + extra_s) / block_s)))

    def cached_hashes(self) -> tuple[list[bytes], list[bytes], list[bytes]]:
        """Every hash in the prefix cache: (device pool, host tier, disk tier), a snapshot for the
        registry."""
        tiers = (self.kv.host_tier, self.kv.disk_tier)
        return self.kv.pool.cached_hashes(), *(t.hashes() if t is not None else [] for t in tiers)
