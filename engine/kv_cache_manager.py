"""Per-sequence block tables on top of the block pool.

The scheduler talks to this class only: how many tokens of a prompt are already cached, can a
sequence get slots for ``k`` more tokens (and with what safety margin), fork a sequence's blocks
for a parallel sample, copy-on-write a shared block before it is written, swap a sequence's blocks
to the CPU pool and back, and free. Block operations the model runner must apply to the KV tensor
(copies, swaps) are returned as (src, dst) pairs.

With a host tier (engine/kv_host_tier.py), a cached block the pool evicts is copied out to host memory
as it is evicted, and a prompt's prefix hit continues from the device's blocks into the host tier's:
those blocks are copied back into fresh device blocks when the request is admitted (the copies are
issued then, on the device's stream, ahead of the step that reads them). With a disk tier under the host
tier (engine/kv_disk_tier.py), a block the host tier evicts is written to disk, and the hit continues
from the host tier's blocks into the disk tier's, read straight into fresh device blocks at admission.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from engine.block_hash import BlockHash
from engine.block_pool import BlockPool
from engine.kv_decode_blocks import DecodeBlocks
from engine.kv_disk_tier import DiskBlocks, DiskTier
from engine.kv_host_tier import HostBlocks, HostTier
from engine.request import Request

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PrefixHit:
    block_ids: list[int]  # device blocks, in prompt order
    num_tokens: int  # tokens of every run
    host_slots: list[int] = field(default_factory=list)  # the host tier's blocks that follow them
    disk_slots: list[int] = field(default_factory=list)  # the disk tier's blocks that follow those


class KVCacheManager(DecodeBlocks):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        num_cpu_blocks: int = 0,
        salt: str = "",
    ) -> None:
        self.block_size = block_size
        self.salt = salt
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        # CPU blocks read by this step's swap-ins: reusable only from the next step on, because the
        # runner applies swap-outs before swap-ins (a same-step swap-out must not overwrite them).
        self._cpu_released: list[int] = []
        self.num_cpu_blocks = num_cpu_blocks
        self.tables: dict[str, list[int]] = {}
        self.held: dict[str, list[int]] = {}
        self.pinned: dict[str, list[int]] = {}  # request id -> blocks a peer may be reading early
        self.cpu_tables: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.prefix_hits_host = 0  # of prefix_hits: tokens loaded from the host tier
        self.prefix_hits_disk = 0  # of prefix_hits: tokens read from the disk tier
        self.host_tier: HostTier | None = None
        self.host_blocks: HostBlocks | None = None
        self.disk_tier: DiskTier | None = None
        self.disk_blocks: DiskBlocks | None = None
        self._unsettled = False  # copies to the host tier issued since the last settle

    def attach_host_tier(self, tier: HostTier, blocks: HostBlocks) -> None:
        """Keep evicted prefix blocks in ``tier`` (bookkeeping) / ``blocks`` (memory and copies)."""
        self.host_tier, self.host_blocks = tier, blocks
        self.pool.on_evict = self._offload

    def attach_disk_tier(self, tier: DiskTier, blocks: DiskBlocks) -> None:
        """Keep blocks the host tier evicts in ``tier`` / ``blocks`` (the file); needs a host tier."""
        if self.host_tier is None:
            raise ValueError("a disk tier goes under a host tier: set kv_host_cache_gib too")
        self.disk_tier, self.disk_blocks = tier, blocks
        self.host_tier.on_evict = self._spill

    def close(self) -> None:
        """Release what outlives the process otherwise: the disk tier's file."""
        if self.disk_blocks is not None:
            self.disk_blocks.close()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_prefix_hit(self, req: Request, host: bool = True) -> PrefixHit:
        """Longest run of the prompt's full blocks already in the cache: on the device, then (``host``:
        the tiers under it) continued in the host tier, then in the disk tier.

        NOTE: at least the prompt's last token is always recomputed: its logits give the first token.
        A request that wants its prompt's logprobs computes every position (no hit).
        """
        if not self.enable_caching or req.params.prompt_logprobs is not None:
            return PrefixHit([], 0)
        req.update_block_hashes(self.block_size, self.salt)
        max_blocks = (req.prompt_len - 1) // self.block_size
        hit: list[int] = []
        for h in req.block_hashes[:max_blocks]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hit.append(b)
        runs: list[list[int]] = []
        if host:
            start = len(hit)
            for tier in (self.host_tier, self.disk_tier):
                run = _run(tier, req.block_hashes[start:max_blocks]) if tier is not None else []
                runs.append(run)
                start += len(run)
        slots, disk = runs or ([], [])
        return PrefixHit(hit, (len(hit) + len(slots) + len(disk)) * self.block_size, slots, disk)

    def record_prefix_query(self, req: Request, hit: PrefixHit) -> None:
        self.prefix_queries += req.prompt_len
        self.prefix_hits += hit.num_tokens
        host, disk = len(hit.host_slots), len(hit.disk_slots)
        if req.read_ahead and host:  # read ahead from disk into the host tier: disk hits
            first = len(hit.block_ids)
            ahead = sum(h in req.read_ahead for h in req.block_hashes[first : first + host])
            host, disk = host - ahead, disk + ahead
        self.prefix_hits_host += host * self.block_size
        self.prefix_hits_disk += disk * self.block_size

    def can_allocate(self, req: Request, num_new_tokens: int, hit: PrefixHit | None, margin: int) -> bool:
        table = self.tables.get(req.request_id, [])
        hit_blocks = hit.block_ids if hit else []
        total = self.blocks_needed(req.num_computed_tokens + num_new_tokens)
        new = max(0, total - len(table) - len(hit_blocks))
        # Free-but-cached hit blocks leave the free queue when taken.
        reclaimed = sum(1 for b in hit_blocks if self.pool.is_free(b))
        return new + self._cow_needed(req) <= self.pool.num_free - reclaimed - margin

    def allocate(
        self, req: Request, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> list[tuple[int, int]]:
        """Give ``req`` slots for ``num_new_tokens`` more tokens (call ``can_allocate`` first).

        Returns block copies (src, dst) owed to copy-on-write. Blocks that these tokens fill are
        registered in the prefix cache now: the step that computes them runs before any reader.
        NOTE: a disk-tier block of ``hit`` that fails its check shortens ``hit`` and the request's
        computed tokens to what was served; the tokens from there on are computed by this step.
        """
        table = self.tables.setdefault(req.request_id, [])
        if hit and hit.block_ids:
            self.pool.touch(hit.block_ids)
            table.extend(hit.block_ids)
            self._num_cached_blocks[req.request_id] = len(hit.block_ids)
        if hit and (hit.host_slots or hit.disk_slots):
            table.extend(self._load_from_tiers(req, len(table), hit))
        copies = self._copy_on_write(req, table)
        total = self.blocks_needed(req.num_computed_tokens + num_new_tokens)
        if total > len(table):
            table.extend(self.pool.allocate(total - len(table)))
        if self.enable_caching:
            self._cache_full_blocks(req, table, req.num_computed_tokens + num_new_tokens)
        return copies

    def forget_uncomputed(self, req: Request, computed: int) -> None:
        """A failed step's share of ``req``: its blocks past the ``computed`` tokens written before
        the step were registered when allocated (``allocate``, a decode's fill) and never written;
        they leave the prefix cache, or the same prompt would hit them and decode from garbage."""
        table = self.tables.get(req.request_id)
        if not table or not self.enable_caching:
            return
        first = computed // self.block_size  # a block partly written before the step is not whole
        self.pool.uncache(table[first:])
        rid = req.request_id
        if self._num_cached_blocks.get(rid, 0) > first:
            self._num_cached_blocks[rid] = first

    def fork(self, parent: Request, child: Request) -> None:
        table = self.tables[parent.request_id]
        self.pool.touch(table)
        self.tables[child.request_id] = list(table)
        self._num_cached_blocks[child.request_id] = self._num_cached_blocks.get(parent.request_id, 0)

    def free(self, req: Request) -> None:
        table = self.tables.pop(req.request_id, None)
        if table:
            self.pool.free(table[::-1])
        self._num_cached_blocks.pop(req.request_id, None)
        cpu = self.cpu_tables.pop(req.request_id, None)
        if cpu:
            self.cpu_free.extend(cpu)

    # Disaggregation ------------------------------------------------------------------------------

    def hold(self, req: Request, key: str | None = None) -> list[int]:
        """Detach a sequence's blocks and keep them allocated under ``key`` (default: its id) until
        ``release_held``: prompt KV a peer will read, or blocks an unfinished transfer may still write."""
        table = self.tables.pop(req.request_id, [])
        self._num_cached_blocks.pop(req.request_id, None)
        self.held[key or req.request_id] = table
        return table

    def release_held(self, request_id: str) -> bool:
        table = self.held.pop(request_id, None)
        if table is None:
            return False
        self.pool.free(table[::-1])
        return True

    def pin(self, key: str, block_ids: list[int]) -> None:
        """Take an extra reference on computed blocks a peer reads while their request still runs:
        preemption, abort or eviction cannot reuse them before ``unpin``."""
        self.pool.touch(block_ids)
        self.pinned.setdefault(key, []).extend(block_ids)

    def unpin(self, key: str) -> None:
        table = self.pinned.pop(key, None)
        if table:
            self.pool.free(table[::-1])

    def allocate_for_transfer(self, req: Request, hit: PrefixHit, num_tokens: int) -> list[int]:
        """Blocks for ``num_tokens`` of pulled KV: prefix hits reused, the rest fresh. Returns the fresh
        ones (to be filled by the transfer). Nothing is registered in the prefix cache until the pull
        completes (``commit_transfer``)."""
        table = self.tables.setdefault(req.request_id, [])
        self.pool.touch(hit.block_ids)
        table.extend(hit.block_ids)
        self._num_cached_blocks[req.request_id] = len(hit.block_ids)
        fresh = self.pool.allocate(self.blocks_needed(num_tokens) - len(table))
        table.extend(fresh)
        self.settle_host_copies()  # evicted blocks copied out before the peer's RDMA writes them
        return fresh

    def settle_host_copies(self) -> None:
        """Wait for the copies to the host tier issued so far (before someone outside the device's
        stream reads or writes the blocks or the host rows: a peer's RDMA)."""
        if self.host_blocks is not None and self._unsettled:
            self.host_blocks.settle()
            self._unsettled = False

    def commit_transfer(self, req: Request) -> None:
        if self.enable_caching:
            self._cache_full_blocks(req, self.tables[req.request_id], req.num_computed_tokens)

    def block_ids(self, req: Request) -> list[int]:
        return self.tables.get(req.request_id, [])

    def begin_step(self) -> None:
        if self._cpu_released:
            self.cpu_free.extend(self._cpu_released)
            self._cpu_released.clear()

    # Swap -----------------------------------------------------------------------------------

    def can_swap_out(self, req: Request) -> bool:
        return len(self.tables.get(req.request_id, ())) <= len(self.cpu_free)

    def swap_out(self, req: Request) -> list[tuple[int, int]]:
        table = self.tables.pop(req.request_id)
        cpu = [self.cpu_free.pop() for _ in table]
        self.cpu_tables[req.request_id] = cpu
        self.pool.free(table[::-1])
        self._num_cached_blocks.pop(req.request_id, None)
        return list(zip(table, cpu))

    def can_swap_in(self, req: Request, margin: int) -> bool:
        return len(self.cpu_tables[req.request_id]) <= self.pool.num_free - margin

    def swap_in(self, req: Request) -> list[tuple[int, int]]:
        cpu = self.cpu_tables.pop(req.request_id)
        table = self.pool.allocate(len(cpu))
        self.tables[req.request_id] = table
        self._cpu_released.extend(cpu)
        if self.enable_caching:
            self._cache_full_blocks(req, table, req.num_computed_tokens)
        return list(zip(cpu, table))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, in the tiers under the pool too; only when no block is in use
        (nor any tier slot pinned: a read landing in it, a peer's lease, a read-ahead held)."""
        tiers = [t for t in (self.host_tier, self.disk_tier) if t is not None]
        if any(t.num_pinned() for t in tiers) or not self.pool.reset_prefix_cache():
            return False
        for tier in tiers:
            tier.clear()
        return True

    # Host tier ------------------------------------------------------------------------------

    def _offload(self, block_id: int, block_hash: BlockHash) -> None:
        """The pool is about to reuse a cached block: its content goes to the host tier first."""
        slot = self.host_tier.store(block_hash)
        if slot is not None:
            self.host_blocks.offload([(block_id, slot)])
            self._unsettled = True

    def _spill(self, block_hash: BlockHash, slot: int) -> None:
        """The host tier is about to reuse ``slot``: its block goes to the disk tier first (written by
        the disk tier's thread; a write that failed since the last spill is forgotten here)."""
        for lost in self.disk_blocks.take_failed():
            self.disk_tier.discard(lost)
        disk_slot = self.disk_tier.store(block_hash)
        if disk_slot is None:
            return
        if self._unsettled:  # the host row may still be on its way from the device
            self.host_blocks.settle()
            self._unsettled = False
        self.disk_blocks.write(disk_slot, block_hash, self.host_blocks.rows[slot])

    def _load_from_tiers(self, req: Request, first: int, hit: PrefixHit) -> list[int]:
        """Fresh device blocks holding the hit's host-tier then disk-tier blocks (blocks ``first``...
        of ``req``), registered in the prefix cache under their hashes. A disk block that fails its
        check ends the hit there: it and the blocks after it are recomputed by this step."""
        host, disk = hit.host_slots, hit.disk_slots
        # NOTE: the allocation's own evictions cascade (device -> host -> disk): pinned slots are not
        # reused by them, so the slots read here still hold what the hit found.
        self._pin_tiers(host, disk, True)
        try:
            blocks = self.pool.allocate(len(host) + len(disk))
            self.host_blocks.load(list(zip(host, blocks)))
            served = len(host) + self._read_from_disk(req, first + len(host), disk, blocks[len(host) :])
        finally:
            self._pin_tiers(host, disk, False)
        hashes = req.block_hashes[first : first + served]
        for b, h in zip(blocks, hashes):
            self.pool.cache(b, h)
        self.host_tier.loaded(hashes[: len(host)])
        if served < len(blocks):  # the rest is computed now, from the first block that failed
            lost = (len(blocks) - served) * self.block_size
            req.num_computed_tokens -= lost
            hit.num_tokens -= lost
            del hit.disk_slots[served - len(host) :]
        self._num_cached_blocks[req.request_id] = first + served
        return blocks

    def _read_from_disk(self, req: Request, first: int, slots: list[int], blocks: list[int]) -> int:
        """Read ``slots`` (blocks ``first``... of ``req``) into ``blocks``; how many leading ones hold
        what their hash says."""
        hashes = req.block_hashes[first : first + len(slots)]
        for i, (slot, h, b) in enumerate(zip(slots, hashes, blocks)):
            if not self.disk_blocks.read(slot, h, b):
                logger.error("disk tier: slot %d does not hold block %s: recomputing it", slot, h.hex())
                self.disk_tier.counters.rejected_blocks += 1
                self.disk_tier.discard(h)
                hashes = hashes[:i]
                break
        if hashes:
            self.disk_tier.loaded(hashes)
        return len(hashes)

    def _pin_tiers(self, host: list[int], disk: list[int], on: bool) -> None:
        for tier, slots in ((self.host_tier, host), (self.disk_tier, disk)):
            if tier is not None and slots:
                (tier.pin if on else tier.unpin)(slots)

    # Internals ------------------------------------------------------------------------------

    def _cow_needed(self, req: Request) -> int:
        table = self.tables.get(req.request_id)
        idx = req.num_computed_tokens // self.block_size
        if table and idx < len(table) and self.pool.ref_cnt[table[idx]] > 1:
            return 1
        return 0

    def _copy_on_write(self, req: Request, table: list[int]) -> list[tuple[int, int]]:
        """The block the next token is written into must be this sequence's alone."""
        idx = req.num_computed_tokens // self.block_size
        if idx >= len(table) or self.pool.ref_cnt[table[idx]] == 1:
            return []
        src = table[idx]
        (dst,) = self.pool.allocate(1)
        self.pool.free([src])
        table[idx] = dst
        return [(src, dst)]

    def _cache_full_blocks(self, req: Request, table: list[int], num_computed: int) -> None:
        done = self._num_cached_blocks.get(req.request_id, 0)
        full = min(num_computed // self.block_size, len(table))
        if full <= done:
            return
        req.update_block_hashes(self.block_size, self.salt)
        full = min(full, len(req.block_hashes))
        for i in range(done, full):
            self.pool.cache(table[i], req.block_hashes[i])
        self._num_cached_blocks[req.request_id] = full


def _run(tier: HostTier, hashes: list[BlockHash]) -> list[int]:
    """The slots of ``tier`` holding the leading ``hashes``, up to the first it lacks."""
    slots: list[int] = []
    for h in hashes:
        slot = tier.lookup(h)
        if slot is None:
            break
        slots.append(slot)
    return slots
