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

    def fill_blocks(self, reqs: list[Request]) -> None:
        """``fill_block`` for each of a steady batch's decodes that fills its block
        (``engine.steady_decodes``): where the hash chain reaches the block before, hashed all
        together and cached in one pass; otherwise as ``fill_block`` does."""
        if not self.enable_caching:
            return
        bs, tables, counts = self.block_size, self.tables, self._num_cached_blocks
        chained: list[Request] = []
        parents: list[BlockHash] = []
        tokens: list[int] = []
        for req in reqs:  # NOTE: every sequence, once per block it fills
            seq_id, hashes, n = req.request_id, req.block_hashes, req.num_computed_tokens + 1
            done = len(hashes)
            if (
                done
                and done == n // bs - 1 == counts.get(seq_id)
                and n <= len(req.token_ids) - req.num_placeholders
            ):
                chained.append(req)
                parents.append(hashes[-1])
                tokens += req.token_ids[n - bs : n]
            else:
                self._cache_full_blocks(req, tables[seq_id], n)
        if not chained:
            return
        filled, blocks = hash_next_blocks(parents, tokens, bs), []
        for req, h in zip(chained, filled):
            seq_id, hashes = req.request_id, req.block_hashes
            blocks.append(tables[seq_id][len(hashes)])
            hashes.append(h)
            counts[seq_id] = len(hashes)
        self.pool.cache_many(blocks, filled)

    def open_blocks(self, reqs: list[Request]) -> list[int] | None:
        """``append_block`` for each of a steady batch's decodes that opens a block, all or none:
        None (nothing allocated) when fewer blocks are free."""
        if len(reqs) > self.pool.num_free:
            return None
        blocks = self.pool.allocate(len(reqs))
        bs, tables, counts = self.block_size, self.tables, self._num_cached_blocks
        for req, block in zip(reqs, blocks):
            table = tables[req.request_id]
            table.append(block)
            if self.enable_caching and counts.get(req.request_id, 0) < (req.num_computed_tokens + 1) // bs:
                self._cache_full_blocks(req, table, req.num_computed_tokens + 1)  # the one before lagged
        return blocks
