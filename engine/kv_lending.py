"""Prefix blocks shared between workers through their host tiers: lent under a lease, received.

A worker whose prompt's prefix lives on a peer can read the peer's blocks over the network instead of
computing them (issue 33: Mooncake's and LMCache's peer sharing). Both ends are host-tier slots, so the
memory a peer reads is the host tier's, registered with a transfer agent of its own
(``worker/peer_tiers.py``); this module is the engine's bookkeeping around such reads:

Owner: ``lend(lease_id, hashes)`` takes the leading run of ``hashes`` this engine holds, on the device
or in its host tier. A device-only block is copied to the host tier first (it is a cached block: the
step that computed it ran before this call). The run's slots are pinned until ``end(lease_id)`` (the
reader's notification) or the lease's expiry (``expire``), so no eviction reuses a slot a peer may
still be reading; each slot comes with the CRC-32 of its bytes.

Reader: ``reserve(hashes)`` takes a host slot for each hash not already held here, pinned and unseen by
prefix lookups; once the read has landed, ``receive`` checks every slot's bytes against the owner's
CRC and publishes those that match under their hash (from then on they are host-tier blocks like any
other: the request's admission loads them to the device); a slot that does not match is freed and its
block recomputed, never served. ``abandon`` frees the slots of a read that failed.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.block_hash import BlockHash

if TYPE_CHECKING:
    from engine.kv_cache_manager import KVCacheManager


@dataclass(slots=True)
class Lease:
    slots: list[int]
    expiry: float  # time.monotonic()


@dataclass(frozen=True, slots=True)
class Lent:
    """What an owner gives a reader: host slots (the request's blocks ``0..len-1``) and their CRCs."""

    slots: list[int]
    checksums: list[int]


class TierLending:
    """Both ends of peer reads of one engine's host tier (engine thread only)."""

    def __init__(self, kv: KVCacheManager, lease_s: float) -> None:
        if kv.host_tier is None or kv.host_blocks is None:
            raise ValueError("sharing prefix blocks with peers needs a host tier (kv_host_cache_gib)")
        if not lease_s > 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self.kv = kv
        self.tier = kv.host_tier
        self.rows = kv.host_blocks.rows
        self.lease_s = lease_s
        self.leases: dict[str, Lease] = {}
        self.expired = 0  # leases that ran out before their reader's notification

    # Owner --------------------------------------------------------------------------------------

    def lend(self, lease_id: str, hashes: list[BlockHash], now: float | None = None) -> Lent:
        """Pin the leading run of ``hashes`` held here (copying device-only blocks to the host tier)
        under ``lease_id``; an empty run takes no lease."""
        if lease_id in self.leases:
            raise ValueError(f"lease {lease_id!r} is already taken")
        slots: list[int] = []
        copies: list[tuple[int, int]] = []
        for h in hashes:
            slot = self.tier.lookup(h)
            if slot is None:
                block = self.kv.pool.lookup(h)
                slot = self.tier.store(h) if block is not None else None
                if slot is None:  # held nowhere, or every host slot is pinned
                    break
                copies.append((block, slot))
            self.tier.pin([slot])  # before the next store's eviction could take it
            slots.append(slot)
        if not slots:
            return Lent([], [])
        self.kv.host_blocks.offload(copies)
        self.kv.host_blocks.settle()  # these copies, and evictions copied out before them (one stream)
        self.leases[lease_id] = Lease(slots, (time.monotonic() if now is None else now) + self.lease_s)
        self.tier.counters.lent_blocks += len(slots)
        return Lent(slots, [checksum(self.rows[s]) for s in slots])

    def end(self, lease_id: str) -> bool:
        """The reader is done (or gone): unpin the lease's slots. False when unknown or already over."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return False
        self.tier.unpin(lease.slots)
        return True

    def expire(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        over = [k for k, lease in self.leases.items() if lease.expiry <= now]
        for lease_id in over:
            self.end(lease_id)
        self.expired += len(over)
        return len(over)

    # Reader -------------------------------------------------------------------------------------

    def reserve(self, hashes: list[BlockHash]) -> list[tuple[int, int]]:
        """``(i, slot)``: a reserved host slot for each ``hashes[i]`` not held here already, in order,
        until no slot can be freed."""
        taken: list[tuple[int, int]] = []
        # The prompt's own host-tier blocks are kept from the reservations' evictions: the read is
        # worth nothing if the hit it extends breaks in front of it.
        own = [slot for h in hashes if (slot := self.tier.lookup(h)) is not None]
        self.tier.pin(own)
        try:
            for i, h in enumerate(hashes):
                if h in self.tier or self.kv.pool.lookup(h) is not None:
                    continue
                slot = self.tier.reserve()
                if slot is None:
                    break
                taken.append((i, slot))
        finally:
            self.tier.unpin(own)
        return taken

    def receive(self, hashes: list[BlockHash], taken: list[tuple[int, int]], checksums: list[int]) -> int:
        """The read into ``taken`` (from ``reserve``) landed: publish each slot whose bytes match the
        owner's CRC of ``hashes[i]``; free the others. Returns the blocks published."""
        published = 0
        for i, slot in taken:
            if checksum(self.rows[slot]) != checksums[i]:
                self.tier.counters.rejected_blocks += 1
                self.tier.release(slot)
            elif self.tier.commit(hashes[i], slot):
                published += 1
        return published

    def abandon(self, taken: list[tuple[int, int]]) -> None:
        for _, slot in taken:
            self.tier.release(slot)

    def close(self) -> None:
        for lease_id in list(self.leases):
            self.end(lease_id)


def checksum(row: torch.Tensor) -> int:
    """CRC-32 of a host row's bytes."""
    return zlib.crc32(row.reshape(-1).view(torch.uint8).numpy())
