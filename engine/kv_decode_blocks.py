"""The KV cache manager's decode fast paths: a decode's token filling its own block (cached once
full) or opening a fresh one, for one sequence (``Scheduler._schedule_running``) and for a steady
batch's sequences at a block boundary together (``engine.steady_decodes``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.block_hash import BlockHash, hash_next_blocks
from engine.block_pool import BlockPool
from engine.request import Request


@dataclass(slots=True)
class FillPlan:
    """What a steady batch's filling decodes cache (``DecodeBlocks.plan_fills``): those whose hash
    chain reaches the block before (indices ``at`` into the decodes), each block's id and hash; and
    whether one of the others caches a block now (``loose``: its last token known, not in flight)."""

    at: Sequence[int]
    blocks: Sequence[int]
    hashes: Sequence[BlockHash]
    loose: bool


class DecodeBlocks:
    """Part of ``engine.kv_cache_manager.KVCacheManager`` (its state: the pool, the tables, how many
    of each sequence's blocks are cached)."""

    block_size: int
    enable_caching: bool
    pool: BlockPool
    tables: dict[str, list[int]]
    _num_cached_blocks: dict[str, int]

    def _cache_full_blocks(self, req: Request, table: list[int], num_computed: int) -> None:
        raise NotImplementedError  # KVCacheManager's

    def fill_block(self, req: Request, table: list[int]) -> bool:
        """The scheduler's fast path, its checks done: ``req``'s next token fills the last slot of
        its own block ``table[pos // block_size]``, which is cached once full. Always True."""
        if self.enable_caching:
            self._cache_full_blocks(req, table, req.num_computed_tokens + 1)
        return True

    def append_block(self, req: Request) -> int | None:
        """Fast path for a decode whose token opens a block: a fresh block appended to its table,
        as ``can_allocate`` + ``allocate`` would (None when none is free: the slow path preempts)."""
        if not self.pool.num_free:
            return None
        table = self.tables[req.request_id]
        (block,) = self.pool.allocate(1)
        table.append(block)
        if self.enable_caching:
            self._cache_full_blocks(req, table, req.num_computed_tokens + 1)
        return block

    def plan_fills(self, reqs: list[Request]) -> FillPlan | None:
        """For a steady batch's decodes ``reqs`` whose tokens fill their blocks: None when one of
        them cannot stay on the fast path (its block missing or shared); else what filling them
        caches, computed and nothing changed (``FillPlan``)."""
        bs, tables, ref_cnt = self.block_size, self.tables, self.pool.ref_cnt
        caching, counted = self.enable_caching, self._num_cached_blocks.get
        at: list[int] = []
        blocks: list[int] = []
        parents: list[BlockHash] = []
        tokens: list[int] = []
        loose = False
        for i, req in enumerate(reqs):  # NOTE: every sequence, once per block it fills
            table = tables[req.request_id]
            idx = req.num_computed_tokens // bs
            if idx >= len(table) or ref_cnt[table[idx]] != 1:
                return None
            if not caching:
                continue
            n, toks = (idx + 1) * bs, req.token_ids
            if n <= len(toks) - req.num_placeholders:  # its last token known (not in flight)
                hashes = req.block_hashes
                done = len(hashes)
                if done and done == idx == counted(req.request_id):  # the chain reaches the block before
                    at.append(i)
                    blocks.append(table[idx])
                    parents.append(hashes[-1])
                    tokens += toks[n - bs : n]
                else:
                    loose = True
        return FillPlan(at, blocks, hash_next_blocks(parents, tokens, bs) if at else [], loose)

    def fill_blocks(self, reqs: list[Request], plan: FillPlan, skip: set[int]) -> None:
        """``fill_block`` for each of ``reqs`` in order, as ``plan_fills`` planned them: the blocks it
        hashed registered in one pass, except those at the indices in ``skip`` (when each filled, by
        the per-request path, a free block held its hash, which an opening after it in the batch
        evicted in the same step); the others as ``fill_block`` caches them."""
        if not self.enable_caching:
            return
        at, counts = plan.at, self._num_cached_blocks
        if len(at) == len(reqs) and not skip:  # every one chained (a steady batch's common case)
            for req, h in zip(reqs, plan.hashes):
                hashes = req.block_hashes
                hashes.append(h)
                counts[req.request_id] = len(hashes)
            self.pool.cache_many(plan.blocks, plan.hashes)
            return
        planned = dict(zip(at, zip(plan.blocks, plan.hashes)))
        blocks: list[int] = []
        filled: list[BlockHash] = []
        for i, req in enumerate(reqs):
            got = planned.get(i)
            if got is None:
                if filled:  # those before it first: the first of equal contents is the one cached
                    self.pool.cache_many(blocks, filled)
                    blocks, filled = [], []
                self._cache_full_blocks(req, self.tables[req.request_id], req.num_computed_tokens + 1)
                continue
            hashes = req.block_hashes
            hashes.append(got[1])
            counts[req.request_id] = len(hashes)
            if i not in skip:
                blocks.append(got[0])
                filled.append(got[1])
        if filled:
            self.pool.cache_many(blocks, filled)

    def lagging(self, reqs: list[Request]) -> bool:
        """Whether one of ``reqs``, whose tokens open a block, has the block before still uncached
        (its last token was in flight when it filled): ``append_block`` caches it."""
        bs, counts = self.block_size, self._num_cached_blocks
        return any(counts.get(r.request_id, 0) < (r.num_computed_tokens + 1) // bs for r in reqs)

    def plan_late_fills(self, reqs: list[Request]) -> FillPlan | None:
        """For decodes ``reqs`` whose tokens open a block: the block before each one's where it is
        not cached yet (its last token was in flight when it filled: overlapped scheduling) and
        the hash chain reaches the block before that, as ``plan_fills`` plans fills; None when one
        lags otherwise (the per-request path caches it)."""
        bs, tables, counted = self.block_size, self.tables, self._num_cached_blocks.get
        at: list[int] = []
        blocks: list[int] = []
        parents: list[BlockHash] = []
        tokens: list[int] = []
        for i, req in enumerate(reqs):  # NOTE: every sequence, once per block it opens, overlapped
            idx = req.num_computed_tokens // bs  # the block it opens; idx - 1 is full now
            rid = req.request_id
            cached = counted(rid, 0)
            if cached >= idx:
                continue
            hashes, toks, n = req.block_hashes, req.token_ids, idx * bs
            # Exactly the one block behind, its chain and tokens in (else: the per-request path).
            if not (1 < idx == len(hashes) + 1 == cached + 1) or n > len(toks) - req.num_placeholders:
                return None
            at.append(i)
            blocks.append(tables[rid][idx - 1])
            parents.append(hashes[-1])
            tokens += toks[n - bs : n]
        return FillPlan(at, blocks, hash_next_blocks(parents, tokens, bs) if at else [], False)

    def open_blocks(self, reqs: list[Request]) -> list[int] | None:
        """``append_block`` for each of a steady batch's decodes that opens a block, in order, all or
        none: None (nothing allocated) when fewer blocks are free. Blocks before them still uncached
        are cached first in one pass, when the allocation evicts none of their hashes (else each is
        cached before the next allocation evicts, request by request)."""
        if len(reqs) > self.pool.num_free:
            return None
        if self.enable_caching and self.lagging(reqs):
            late = self.plan_late_fills(reqs)
            if late is None or not self.pool.evictions(len(reqs)).keys().isdisjoint(late.hashes):
                return [self.append_block(req) for req in reqs]
            self.fill_blocks(reqs, late, set())
        blocks = self.pool.allocate(len(reqs))
        tables = self.tables
        for req, block in zip(reqs, blocks):
            tables[req.request_id].append(block)
        return blocks

    def boundary_in_order(self, reqs: list[Request], opening: set[int]) -> list[int] | None:
        """A steady batch's boundary members ``reqs``, in batch order, each as the per-request path
        takes it: ``append_block`` for those in ``opening`` (by ``id``), ``fill_block`` for the
        others; the blocks opened, in order, or None (nothing changed) when too few are free."""
        if len(opening) > self.pool.num_free:
            return None
        blocks, tables = [], self.tables
        for req in reqs:
            if id(req) in opening:
                blocks.append(self.append_block(req))
            else:
                self.fill_block(req, tables[req.request_id])
        return blocks
