"""The engine's side of peer reads (engine/kv_lending.py) on a real block tensor with a 4-slot host
tier: what a lease pins, what a reservation hides, what a CRC lets through."""

from __future__ import annotations

import pytest
import torch
from test_kv_cache_manager import BS, make_request
from test_kv_host_tier import _compute, _manager

from engine.kv_lending import TierLending, checksum


def _owner():
    kv, device = _manager(num_blocks=8, host_slots=4)
    req = make_request("a", list(range(3 * BS + 1)))
    _compute(kv, device, req)
    kv.free(req)
    return kv, device, req.block_hashes[:3]


def test_a_lease_pins_its_slots_against_the_tiers_evictions():
    kv, device, hashes = _owner()
    lending = TierLending(kv, lease_s=10)
    lent = lending.lend("L", hashes)
    assert len(lent.slots) == 3  # device-only blocks, copied to the host tier for the read
    rows = kv.host_blocks.rows
    assert all(torch.equal(rows[s], device[kv.pool.lookup(h)]) for s, h in zip(lent.slots, hashes))
    # Six other blocks evicted into the full tier: only the one free slot turns over.
    for i in range(6):
        kv.host_tier.store(bytes([i + 1]) * 16)
    assert all(h in kv.host_tier for h in hashes)
    assert [checksum(rows[s]) for s in lent.slots] == lent.checksums
    assert kv.host_tier.counters.evicted_blocks == 5  # the fourth slot, five times over
    assert lending.end("L") and not lending.end("L")
    for i in range(3):
        kv.host_tier.store(bytes([i + 10]) * 16)
    assert not any(h in kv.host_tier for h in hashes)  # unpinned: evicted like any other


def test_a_reserved_slot_is_found_only_once_its_block_is_received():
    kv, _, hashes = _owner()
    reader = TierLending(kv, lease_s=10)
    other = [bytes([i + 1]) * 16 for i in range(3)]
    taken = reader.reserve([hashes[0], *other])  # hashes[0] is on the device already
    assert [i for i, _ in taken] == [1, 2, 3]
    assert not any(h in kv.host_tier for h in other)
    sums = [0, *(checksum(kv.host_blocks.rows[s]) for _, s in taken)]
    sums[2] ^= 1  # the second block's bytes are not what the owner sent
    assert reader.receive([hashes[0], *other], taken, sums) == 2
    assert other[0] in kv.host_tier and other[1] not in kv.host_tier and other[2] in kv.host_tier
    assert kv.host_tier.counters.rejected_blocks == 1 and kv.host_tier.counters.received_blocks == 2
    assert not kv.host_tier._pinned


def test_lending_needs_a_host_tier():
    from engine.kv_cache_manager import KVCacheManager

    with pytest.raises(ValueError, match="host tier"):
        TierLending(KVCacheManager(8, BS), lease_s=10)


def test_reservations_do_not_evict_the_prompts_own_host_blocks():
    """A 4-slot tier holding the prompt's block 0 and three others (block 0 the oldest): reserving
    blocks 1-3 evicts the three others, never block 0, which the read's hit starts from."""
    kv, _, hashes = _owner()
    tier = kv.host_tier
    tier.store(hashes[0])
    others = [bytes([i + 1]) * 16 for i in range(3)]
    for h in others:
        tier.store(h)
    wanted = [hashes[0], *(bytes([i + 50]) * 16 for i in range(3))]
    taken = TierLending(kv, lease_s=10).reserve(wanted)
    assert [i for i, _ in taken] == [1, 2, 3]
    assert hashes[0] in tier and not any(h in tier for h in others)
