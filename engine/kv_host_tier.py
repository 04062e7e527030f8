"""The host tier of the prefix cache: blocks evicted from the device pool, kept in host memory.

When the device pool hands out a free block that still holds a cached prefix block (lazy eviction,
engine/block_pool.py), the block's content is copied into this tier first, under the same chained hash.
A later prompt whose prefix continues past the device's hits into this tier gets those blocks copied
back into fresh device blocks instead of recomputing them (``KVCacheManager.find_prefix_hit``). The tier
is LRU over its slots; a slot being read back is pinned so no offload of the same step overwrites it.

Copies run on the device's stream in the order they are issued, so a copy issued while scheduling
step N lands before step N's forward reads or writes the blocks, and an offload into a slot lands after
an earlier load out of it. Nothing here costs anything while the working set fits the device pool: a
block is copied out only when the pool evicts it (write-back), and only once (a block loaded back
keeps its host copy, so evicting it again is a recency update).

This module is the bookkeeping (slots, LRU, pins, events, counters); ``HostBlocks`` holds the memory.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.block_hash import BlockHash
from engine.block_pool import HOST, BlockRemoved, BlockStored, KVEvent
from engine.kv_quant import block_rows


@dataclass(slots=True)
class TierCounters:
    """Totals since start (monotonic): what ``EngineStats`` and /metrics report per tier."""

    offloaded_blocks: int = 0  # copies into this tier (device -> host; host -> disk)
    loaded_blocks: int = 0  # copies back to the device (prefix hits served from this tier)
    evicted_blocks: int = 0  # dropped from the tier for room
    dropped_offloads: int = 0  # evictions not kept: every slot pinned by loads of the same step
    rejected_blocks: int = 0  # found but not served: the content failed its check (disk tier, peers)
    received_blocks: int = 0  # copies from a peer's tier into this one (engine/kv_lending.py)
    lent_blocks: int = 0  # blocks of this tier a peer was given to read


class HostTier:
    """LRU of ``num_slots`` host blocks keyed by block hash (no memory: see ``HostBlocks``). The disk
    tier keeps the same bookkeeping under its own name (engine/kv_disk_tier.py)."""

    TIER = HOST  # the tier its events name

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"the {self.TIER} tier needs at least one block, got {num_slots}")
        self.num_slots = num_slots
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()  # oldest first
        self._free = list(range(num_slots - 1, -1, -1))
        self._pinned: Counter[int] = Counter()  # slot -> holders (loads, leases, reads in flight)
        self._events: list[KVEvent] = []
        self.recording = True  # as the block pool's
        self.counters = TierCounters()
        # Called with (hash, slot) as a block is evicted for room, before the slot is reused (a disk
        # tier under this one writes the block out: engine/kv_disk_tier.py).
        self.on_evict: Callable[[BlockHash, int], None] | None = None

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slots

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._slots.get(block_hash)

    def hashes(self) -> list[BlockHash]:
        return list(self._slots)

    def store(self, block_hash: BlockHash) -> int | None:
        """A slot for ``block_hash``'s content, or None when it is held already (its recency is
        refreshed: no copy needed) or no slot can be freed (all pinned)."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return None
        if self._free:
            slot = self._free.pop()
        else:
            slot = self._evict_one()
            if slot is None:
                self.counters.dropped_offloads += 1
                return None
        self._slots[block_hash] = slot
        self._record(BlockStored([block_hash], self.TIER))
        self.counters.offloaded_blocks += 1
        return slot

    def pin(self, slots: list[int]) -> None:
        """Keep ``slots`` from reuse (until as many ``unpin``): while their loads are issued, while a
        peer may read them (a lease), while a peer's blocks land in them."""
        self._pinned.update(slots)

    def unpin(self, slots: list[int]) -> None:
        self._pinned.subtract(slots)
        for slot in slots:
            if self._pinned[slot] <= 0:
                self._pinned.pop(slot, None)

    def num_pinned(self) -> int:
        return len(self._pinned)

    def reserve(self) -> int | None:
        """A free slot (evicting for room) that no lookup finds until ``commit``: where a peer's block
        lands. Pinned; None when every slot is pinned."""
        slot = self._free.pop() if self._free else self._evict_one()
        if slot is not None:
            self._pinned[slot] += 1
        return slot

    def commit(self, block_hash: BlockHash, slot: int, received: bool = True) -> bool:
        """A reserved ``slot`` now holds ``block_hash``'s content: found by lookups from now on. False
        (the slot is freed) when the hash arrived meanwhile by another way. ``received``: it came
        from a peer (counted), not from this engine's disk tier."""
        self.unpin([slot])
        if block_hash in self._slots:
            self._free.append(slot)
            return False
        self._slots[block_hash] = slot
        self._record(BlockStored([block_hash], self.TIER))
        self.counters.received_blocks += received
        return True

    def release(self, slot: int) -> None:
        """A reserved slot whose block never (validly) landed goes back to the free slots."""
        self.unpin([slot])
        self._free.append(slot)

    def loaded(self, hashes: list[BlockHash]) -> None:
        """``hashes`` were copied back to the device: most recently used, and counted (one dropped
        meanwhile, e.g. its write to the disk tier failed, is counted and otherwise left out)."""
        for h in hashes:
            if h in self._slots:
                self._slots.move_to_end(h)
        self.counters.loaded_blocks += len(hashes)

    def discard(self, block_hash: BlockHash) -> None:
        """Forget ``block_hash`` (its content failed a check, or could not be written): a miss from now on."""
        slot = self._slots.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)
            self._record(BlockRemoved([block_hash], self.TIER))

    def clear(self) -> None:
        if self._slots:
            self._record(BlockRemoved(list(self._slots), self.TIER))
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._slots.clear()

    def _record(self, event: KVEvent) -> None:
        if self.recording:
            self._events.append(event)

    def drain_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def _evict_one(self) -> int | None:
        for h, slot in self._slots.items():
            if slot not in self._pinned:
                del self._slots[h]
                self._record(BlockRemoved([h], self.TIER))
                self.counters.evicted_blocks += 1
                if self.on_evict is not None:
                    self.on_evict(h, slot)
                return slot
        return None


def attach_host_tier(kv, kv_cache, gib: float) -> int:
    """Give ``kv`` (a ``KVCacheManager``) a host tier of ``gib`` GiB for the pool ``kv_cache``; returns
    its size in blocks."""
    rows = block_rows(kv_cache)
    slots = HostBlocks.slots_for_budget(rows, gib)
    row_bytes = rows[0].numel() * rows.element_size()
    if slots < 1:
        raise ValueError(f"kv_host_cache_gib={gib} holds no block of {row_bytes} bytes")
    check_host_room("kv_host_cache_gib", gib, slots * row_bytes)
    blocks = HostBlocks(rows, slots)
    blocks.calibrate()
    kv.attach_host_tier(HostTier(slots), blocks)
    return slots


def available_host_bytes() -> int | None:
    """Host memory a new allocation can take: ``MemAvailable``, capped by the cgroup's limit (a
    container's) less its use; None where neither can be read."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                found.append(max(0, int(limit) - int(f.read())))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_host_room(option: str, gib: float, nbytes: int) -> None:
    """Refuse, naming ``option``, host memory the host has not got: torch's allocator fails with an
    unhelpful message, or on CPU allocates lazily and fails (or is OOM-killed) once the blocks fill."""
    free = available_host_bytes()
    if free is not None and nbytes > free:
        raise ValueError(
            f"{option}={gib:g} needs {nbytes / 2**30:.2f} GiB of host memory; {free / 2**30:.2f} GiB "
            f"is available on this host (lower {option})"
        )


class HostBlocks:
    """The host tier's memory: rows shaped like the device pool's block rows (pinned on a GPU host, so
    copies are asynchronous DMA), and the copies between the two."""

    def __init__(self, device_rows: torch.Tensor, num_slots: int) -> None:
        self.device_rows = device_rows
        pin = device_rows.device.type == "cuda"
        self.rows = torch.empty((num_slots, *device_rows.shape[1:]), dtype=device_rows.dtype, pin_memory=pin)
        self.load_s_per_block: float | None = None  # measured: what a host hit costs the router's model
        # Peer reads into this tier (worker/peer_tiers.py): on, and their measured time per block.
        self.peer_reads = False
        self.peer_read_s_per_block: float | None = None

    def calibrate(self, rounds: int = 3) -> None:
        """Time copying a few blocks back, waiting for them (at start, while every device block is
        free). The best of ``rounds`` is the load cost per block. The blocks are copied out first, so
        the loads put back what they held: the host rows start uninitialized, and garbage in a device
        block (NaN, say) reaches attention through a sequence's unwritten, masked slots (0 × NaN)."""
        n = min(8, len(self.rows), len(self.device_rows))
        pairs = [(i, i) for i in range(n)]
        self.offload(pairs)
        self.settle()
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            self.load(pairs)
            self.settle()
            best = min(best, time.perf_counter() - t0)
        self.load_s_per_block = best / n

    @staticmethod
    def slots_for_budget(device_rows: torch.Tensor, gib: float) -> int:
        row_bytes = device_rows[0].numel() * device_rows.element_size()
        return int(gib * (1 << 30)) // row_bytes

    def offload(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, host slot): copy each block out before the pool reuses it."""
        for block, slot in pairs:
            self.rows[slot].copy_(self.device_rows[block], non_blocking=True)

    def load(self, pairs: list[tuple[int, int]]) -> None:
        """(host slot, device block): copy each block back."""
        for slot, block in pairs:
            self.device_rows[block].copy_(self.rows[slot], non_blocking=True)

    def settle(self) -> None:
        """Wait for the copies issued so far (before someone outside the stream writes the blocks: a
        KV transfer's RDMA)."""
        if self.device_rows.device.type == "cuda":
            torch.cuda.current_stream(self.device_rows.device).synchronize()
