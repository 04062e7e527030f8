"""BlockPool: reference counts, LRU free queue with lazy eviction, and prefix-cache events."""

from __future__ import annotations

import pytest

from engine.block_hash import hash_blocks
from engine.block_pool import AllBlocksCleared, BlockPool, BlockRemoved, BlockStored

H = hash_blocks(list(range(40)), 4)  # ten distinct, chained block hashes


def test_allocate_takes_blocks_and_free_gives_them_back() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3
    assert [pool.ref_cnt[b] for b in blocks] == [1, 1, 1]
    assert pool.num_free == 1
    assert pool.usage() == pytest.approx(0.75)
    pool.free(blocks)
    assert pool.num_free == 4
    assert all(pool.is_free(b) for b in blocks)


def test_a_touched_block_needs_one_free_per_reference() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.touch([b])
    assert pool.ref_cnt[b] == 2
    pool.free([b])
    assert not pool.is_free(b) and pool.num_free == 1
    pool.free([b])
    assert pool.is_free(b) and pool.num_free == 2


def test_freeing_more_often_than_referenced_raises() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="freed more often than referenced"):
        pool.free([b])


def test_allocating_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(RuntimeError, match="cannot allocate 2 blocks, only 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1


def test_non_positive_pool_size_is_rejected() -> None:
    with pytest.raises(ValueError, match="num_blocks must be positive"):
        BlockPool(0)


def test_free_queue_is_lru_so_tail_first_freeing_keeps_the_prefix_longest() -> None:
    pool = BlockPool(4)
    seq = pool.allocate(4)
    for b, h in zip(seq, H):
        pool.cache(b, h)
    pool.free(seq[::-1])  # tail first, as KVCacheManager.free does
    # New allocations evict the last block of the sequence first, its first block last.
    for evicted in range(1, 5):
        pool.allocate(1)
        still_cached = [pool.lookup(h) for h in H[:4]]
        assert still_cached == [*seq[: 4 - evicted], *([None] * evicted)]


def test_blocks_freed_last_are_reused_last() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.free([b])
    pool.free([a])
    pool.free([c])
    assert pool.allocate(3) == [b, a, c]


def test_freed_cached_block_can_be_taken_back_until_it_is_reallocated() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.cache(b, H[0])
    pool.free([b])
    pool.drain_events()
    # Free but still cached: a later request with the same prefix finds it and takes a reference.
    assert pool.lookup(H[0]) == b
    pool.touch([b])
    assert pool.ref_cnt[b] == 1 and pool.num_free == 1
    assert pool.drain_events() == []  # no eviction happened
    pool.free([b])
    # Only when the block is handed out for new content does it lose its hash.
    other = pool.allocate(1)
    assert other != [b] and pool.lookup(H[0]) == b
    assert pool.allocate(1) == [b]
    assert pool.lookup(H[0]) is None and pool.block_hash[b] is None
    assert pool.drain_events() == [BlockRemoved([H[0]])]


def test_duplicate_hash_keeps_the_first_writer() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache(a, H[0])
    pool.cache(b, H[0])
    assert pool.lookup(H[0]) == a
    assert pool.block_hash[b] is None
    assert pool.num_cached == 1
    assert pool.drain_events() == [BlockStored([H[0]])]
    # Evicting the duplicate's block must not drop the first writer's entry.
    pool.free([b])
    pool.allocate(2)
    assert pool.lookup(H[0]) == a
    assert pool.drain_events() == []


def test_a_block_keeps_its_first_hash() -> None:
    pool = BlockPool(1)
    (b,) = pool.allocate(1)
    pool.cache(b, H[0])
    pool.cache(b, H[1])
    assert pool.lookup(H[0]) == b and pool.lookup(H[1]) is None


def test_caching_disabled_stores_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.allocate(1)
    pool.cache(b, H[0])
    assert pool.lookup(H[0]) is None and pool.num_cached == 0
    assert pool.drain_events() == []


def test_caching_many_at_once_is_caching_each_in_one_event() -> None:
    """A steady batch's filled blocks (``cache_many``): the same entries as ``cache`` of each pair
    (first writer wins, a block keeps its first hash), stored in one event."""
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    pool.cache(d, H[3])
    pool.drain_events()
    pool.cache_many([a, b, c, d], [H[0], H[0], H[1], H[2]])
    assert [pool.lookup(h) for h in H[:4]] == [a, c, None, d]
    assert pool.block_hash[b] is None
    assert pool.drain_events() == [BlockStored([H[0], H[1]])]
    pool.cache_many([b], [H[1]])  # nothing new: no event
    assert pool.drain_events() == []
    off = BlockPool(1, enable_caching=False)
    off.cache_many(off.allocate(1), [H[0]])
    assert off.lookup(H[0]) is None and off.drain_events() == []


def test_events_record_stores_and_removals_in_order_and_drain_empties_them() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, H[0])
    pool.cache(b, H[1])
    pool.free([b, a])
    pool.allocate(1)  # evicts b (freed first)
    assert pool.drain_events() == [BlockStored([H[0]]), BlockStored([H[1]]), BlockRemoved([H[1]])]
    assert pool.drain_events() == []
    pool.allocate(1)  # evicts a
    assert pool.drain_events() == [BlockRemoved([H[0]])]


def test_reset_prefix_cache_clears_every_hash_when_nothing_is_in_use() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for b, h in zip(blocks, H):
        pool.cache(b, h)
    pool.drain_events()
    pool.free(blocks)
    assert pool.reset_prefix_cache()
    assert pool.num_cached == 0
    assert all(pool.lookup(h) is None for h in H[:3])
    assert all(pool.block_hash[b] is None for b in blocks)
    assert pool.drain_events() == [AllBlocksCleared()]
    # Reallocating a cleared block reports no removal: the clear already covered it.
    pool.allocate(3)
    assert pool.drain_events() == []


def test_reset_prefix_cache_refuses_while_blocks_are_in_use() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.cache(b, H[0])
    pool.drain_events()
    assert not pool.reset_prefix_cache()
    assert pool.lookup(H[0]) == b
    assert pool.drain_events() == []
