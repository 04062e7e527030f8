"""The pool of KV blocks: reference counts, a free queue in eviction order, and the prefix cache.

A block is free when its reference count is 0. A free block keeps its hash (lazy eviction) so a
later request with the same prefix can take it back; it loses the hash only when it is handed out
for new content. The free queue is LRU: blocks freed last are evicted last, and callers free a
request's blocks tail-first so a shared prefix outlives its suffixes. Every change to the set of
cached hashes is recorded as an event for the global prefix index.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice

from engine.block_hash import BlockHash

DEVICE, HOST, DISK = "device", "host", "disk"  # the prefix cache's tiers: the KV pool, host memory, a file


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[BlockHash]
    tier: str = DEVICE


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    tier: str = DEVICE


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self._events: list[KVEvent] = []
        self.recording = True  # off: no events kept (an engine nobody subscribed to: EngineCore)
        # Called with (block, hash) as a cached block is evicted, before it is handed out (a host tier
        # copies its content out: engine/kv_host_tier.py).
        self.on_evict: Callable[[int, BlockHash], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash in the prefix cache (for a full snapshot of this engine's index entries)."""
        return list(self._cached)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def is_free(self, block_id: int) -> bool:
        return self.ref_cnt[block_id] == 0

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on blocks found in the cache (they may be free-but-cached)."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                del self._free[b]
            self.ref_cnt[b] += 1

    def evictions(self, n: int) -> dict[BlockHash, int]:
        """The cached hashes ``allocate(n)`` now would evict, each with the index of its block among
        the ``n`` allocated."""
        hashes, cached, out = self.block_hash, self._cached, {}
        for i, b in enumerate(islice(self._free, n)):
            h = hashes[b]
            if h is not None and cached.get(h) == b:
                out[h] = i
        return out

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} blocks, only {len(self._free)} free")
        out = []
        pop, hashes, ref_cnt = self._free.popitem, self.block_hash, self.ref_cnt
        for _ in range(n):  # NOTE: every block a batch opens (256 at once when a steady batch does)
            b, _ = pop(last=False)
            if hashes[b] is not None:  # still cached from its last use: evicted now
                self._evict(b)
            ref_cnt[b] = 1
            out.append(b)
        return out

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference per block; pass a request's blocks tail-first (see module doc)."""
        for b in block_ids:
            rc = self.ref_cnt[b] - 1
            if rc < 0:
                raise RuntimeError(f"block {b} freed more often than referenced")
            self.ref_cnt[b] = rc
            if rc == 0:
                self._free[b] = None

    def cache(self, block_id: int, block_hash: BlockHash) -> None:
        """Register a full, computed block under its hash (first writer wins on duplicates)."""
        if not self.enable_caching or self.block_hash[block_id] is not None:
            return
        if block_hash in self._cached:
            return
        self.block_hash[block_id] = block_hash
        self._cached[block_hash] = block_id
        if self.recording:  # NOTE: every decode that fills a block: no event built for nobody
            self._events.append(BlockStored([block_hash]))

    def cache_many(self, block_ids: list[int], block_hashes: list[BlockHash]) -> None:
        """``cache`` of each pair, one event for those registered (a steady batch's filled blocks)."""
        if not self.enable_caching:
            return
        owner, cached, stored = self.block_hash, self._cached, []
        for b, h in zip(block_ids, block_hashes):  # NOTE: every block a steady batch fills
            if owner[b] is None and h not in cached:
                owner[b] = h
                cached[h] = b
                stored.append(h)
        if self.recording and stored:
            self._events.append(BlockStored(stored))

    def uncache(self, block_ids: list[int]) -> None:
        """Blocks registered before their KV was written, which a failed step never wrote: out of
        the prefix cache (one event), their content dropped, not handed to ``on_evict``."""
        hashes, cached, removed = self.block_hash, self._cached, []
        for b in block_ids:
            h = hashes[b]
            if h is not None:
                hashes[b] = None
                if cached.get(h) == b:
                    del cached[h]
                    removed.append(h)
        if removed:
            self._record(BlockRemoved(removed))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for b in self._cached.values():
            self.block_hash[b] = None
        self._cached.clear()
        self._record(AllBlocksCleared())
        return True

    def _record(self, event: KVEvent) -> None:
        if self.recording:
            self._events.append(event)

    def drain_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def _evict(self, block_id: int) -> None:
        h = self.block_hash[block_id]
        if h is not None:
            self.block_hash[block_id] = None
            if self._cached.get(h) == block_id:
                del self._cached[h]
                self._record(BlockRemoved([h]))
                if self.on_evict is not None:
                    self.on_evict(block_id, h)
