"""The KV cache manager's decode fast paths: a decode's token filling its own block (cached once
full) or opening a fresh one, for one sequence (``Scheduler._schedule_running``) and for a steady
batch's sequences at a block boundary together (``engine.steady_decodes``)."""

from __future__ import annotations

from engine.block_hash import BlockHash, hash_next_blocks
from engine.block_pool import BlockPool
from engine.request import Request


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

    def plan_fills(self, reqs: list[Request]) -> tuple[dict[int, BlockHash], bool]:
        """For a steady batch's decodes ``reqs`` that fill their blocks: the hash of each block whose
        hash chain reaches the block before (by ``id`` of its request; computed together, nothing
        changed), and whether one of the others caches a block now (``fill_block``'s way: its last
        token is known, not in flight)."""
        if not self.enable_caching:
            return {}, False
        bs, counts = self.block_size, self._num_cached_blocks
        chained: list[int] = []
        parents: list[BlockHash] = []
        tokens: list[int] = []
        loose = False
        for req in reqs:  # NOTE: every sequence, once per block it fills
            hashes, n = req.block_hashes, req.num_computed_tokens + 1
            known = n <= len(req.token_ids) - req.num_placeholders
            done = len(hashes)
            if known and done and done == n // bs - 1 == counts.get(req.request_id):
                chained.append(id(req))
                parents.append(hashes[-1])
                tokens += req.token_ids[n - bs : n]
            else:
                loose = loose or known
        if not chained:
            return {}, loose
        return dict(zip(chained, hash_next_blocks(parents, tokens, bs))), loose

    def fill_blocks(self, reqs: list[Request], hashed: dict[int, BlockHash], skip: set[int]) -> None:
        """``fill_block`` for each of ``reqs`` in order, those in ``hashed`` (``plan_fills``) cached
        together: each filled block registered under its hash, except for the requests in ``skip``
        (by ``id``: when it filled, by the per-request path, a free block held that hash; an opening
        in the same step, after it in the batch, evicted it since)."""
        if not self.enable_caching:
            return
        tables, counts = self.tables, self._num_cached_blocks
        blocks: list[int] = []
        filled: list[BlockHash] = []
        for req in reqs:  # NOTE: every sequence, once per block it fills
            h = hashed.get(id(req))
            if h is None:
                if filled:  # those before it first: the first of equal contents is the one cached
                    self.pool.cache_many(blocks, filled)
                    blocks, filled = [], []
                self._cache_full_blocks(req, tables[req.request_id], req.num_computed_tokens + 1)
                continue
            seq_id, hashes = req.request_id, req.block_hashes
            if id(req) not in skip:
                blocks.append(tables[seq_id][len(hashes)])
                filled.append(h)
            hashes.append(h)
            counts[seq_id] = len(hashes)
        if filled:
            self.pool.cache_many(blocks, filled)

    def lagging(self, reqs: list[Request]) -> bool:
        """Whether one of ``reqs``, whose tokens open a block, has the block before still uncached
        (its last token was in flight when it filled): ``append_block`` caches it."""
        bs, counts = self.block_size, self._num_cached_blocks
        return any(counts.get(r.request_id, 0) < (r.num_computed_tokens + 1) // bs for r in reqs)

    def open_blocks(self, reqs: list[Request]) -> list[int] | None:
        """``append_block`` for each of a steady batch's decodes that opens a block, in order, all or
        none: None (nothing allocated) when fewer blocks are free."""
        if len(reqs) > self.pool.num_free:
            return None
        if self.enable_caching and self.lagging(reqs):  # each cached before the next allocation evicts
            return [self.append_block(req) for req in reqs]
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
