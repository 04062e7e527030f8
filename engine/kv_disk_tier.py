"""The disk tier of the prefix cache: blocks evicted from the host tier, kept in a file of bounded size.

A block's way down and back: the device pool evicts it into the host tier (engine/kv_host_tier.py);
when the host tier needs its slot, the block is written here under the same chained hash (write-back,
once: a block already here only has its recency refreshed). A prompt whose prefix continues past the
device's and the host tier's hits into this tier gets those blocks read back when it is admitted
(``KVCacheManager.find_prefix_hit`` / ``allocate``). The tier is LRU over its slots (the host tier's
bookkeeping, ``DiskTier``); a slot being read is pinned so no write of the same admission reuses it.

Read path: straight from the file into the request's fresh device blocks, not through a host slot.
Staging in the host tier would take a host slot, and evicting one for it writes another block here in
the middle of an admission (a cascade the pins would have to cover twice), then copy the block a
second time. Reading straight in is one ``preadv`` into the device row on CPU, and on a GPU one read
into a pinned staging row plus one copy. The block keeps its copy here (as a block loaded from the host
tier keeps its host copy), so evicting it again costs no write. That read, inside the admitting step,
is what is left for blocks not read ahead: a request whose prefix reaches this tier is usually staged
when added and its blocks read into the host tier by this tier's reader thread first
(``read_ahead``, engine/kv_disk_prefetch.py). The read cost is measured (``calibrate``): the router
weighs a disk hit by it.

Write path: off the engine's thread. The host tier overflows inside an admission, on the engine's
thread, and the slot it frees is reused at once: the block's bytes are copied out (a ``memcpy``) and
queued for a writer thread, which computes the CRC and ``pwritev``s the record (both release the GIL),
so the step goes on while the disk works. Until its write lands, a record is read from its queued
copy (the latest one queued for its slot). At most ``MAX_QUEUED_BYTES`` wait: past that, queueing
blocks until the writer catches up (a disk slower than the evictions slows the engine rather than
growing memory without bound). A write that fails is logged and its block forgotten by the tier
(``take_failed``); a read of its slot would fail its check anyway and recompute.

The file: ``num_slots`` records of a 32-byte header (the block's hash and the CRC32 of its bytes) and
the block's bytes, as the device pool's rows hold them. A read checks the header's hash against the
hash the bookkeeping expects and the CRC against the bytes read: a block that fails is not served (its
tokens are recomputed) and is dropped from the tier.

Lifetime: the file is created at start (``kv_disk_cache_dir``, used as is, or a fresh temporary
directory), sized to its bound at once, and unlinked at once (the temporary directory removed with
it): only its descriptor keeps it, so the kernel frees its room however the process ends, a SIGKILL
or an OOM kill included (a crash-looping worker used to leave a file a crash, until the directory's
free-space check refused every start). ``ls`` no longer lists it; ``lsof`` shows it ``(deleted)``.
A directory that cannot hold it fails the start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import struct
import tempfile
import threading
import time
import weakref
import zlib
from dataclasses import dataclass

import torch

from engine.block_hash import BlockHash
from engine.block_pool import DISK
from engine.kv_host_tier import HostTier
from engine.kv_quant import block_rows

logger = logging.getLogger(__name__)
HEADER = struct.Struct("<16sI12x")  # block hash, CRC32 of the block's bytes, padding to 32 bytes
MAX_QUEUED_BYTES = 256 << 20  # block copies waiting for the writer thread, at most (at least 2 blocks)


class DiskTier(HostTier):
    """LRU of ``num_slots`` file records keyed by block hash: the host tier's bookkeeping, events
    tagged ``disk`` (no I/O: see ``DiskBlocks``)."""

    TIER = DISK


def attach_disk_tier(kv, kv_cache, gib: float, directory: str | None) -> int:
    """Give ``kv`` (a ``KVCacheManager`` with a host tier) a disk tier of ``gib`` GiB in ``directory``
    for the pool ``kv_cache``; returns its size in blocks."""
    rows = block_rows(kv_cache)
    slots = DiskBlocks.slots_for_budget(rows, gib)
    if slots < 1:
        raise ValueError(f"kv_disk_cache_gib={gib} holds no block of {DiskBlocks.record_bytes(rows)} bytes")
    blocks = DiskBlocks(rows, slots, directory)
    try:
        blocks.calibrate()
        kv.attach_disk_tier(DiskTier(slots), blocks)
    except BaseException:
        blocks.close()
        raise
    logger.info("KV disk tier: %d blocks (%.2f GiB) in %s (unlinked: freed on exit)", slots, gib, blocks.path)
    return slots


class DiskBlocks:
    """The disk tier's file: a record per slot, and the reads and writes between it and the pools."""

    def __init__(self, device_rows: torch.Tensor, num_slots: int, directory: str | None = None) -> None:
        self.device_rows = device_rows
        self.num_slots = num_slots
        self.record_size = self.record_bytes(device_rows)
        self.path, fd = _create_file(directory, num_slots * self.record_size)  # the name it had
        self._fd = fd
        self._io = _FileIO(fd, self.path, self.record_size, max(2, MAX_QUEUED_BYTES // self.record_size))
        self._closer = weakref.finalize(self, _close, self._io, fd)
        # On a GPU a read lands in host memory first (pinned: the copy up is one DMA).
        on_gpu = device_rows.device.type == "cuda"
        shape, dtype = device_rows.shape[1:], device_rows.dtype
        self._staging = torch.empty(shape, dtype=dtype, pin_memory=True) if on_gpu else None
        self.load_s_per_block: float | None = None  # measured: what a disk hit costs the router's model

    @staticmethod
    def record_bytes(device_rows: torch.Tensor) -> int:
        return HEADER.size + device_rows[0].numel() * device_rows.element_size()

    @classmethod
    def slots_for_budget(cls, device_rows: torch.Tensor, gib: float) -> int:
        return int(gib * (1 << 30)) // cls.record_bytes(device_rows)

    @property
    def open_path(self) -> str:
        """A path that opens the (unlinked) file while this process holds it."""
        return f"/proc/self/fd/{self._fd}"

    @property
    def closed(self) -> bool:
        return not self._closer.alive

    def write(self, slot: int, block_hash: BlockHash, row: torch.Tensor) -> None:
        """Store ``row`` (a host-memory block, free to reuse once this returns) in ``slot`` under
        ``block_hash``: copied and queued for the writer thread; reads see it at once."""
        self._io.submit(slot, block_hash, row)

    def take_failed(self) -> list[BlockHash]:
        """The blocks whose writes failed since the last call (their records are not on disk)."""
        return self._io.take_failed()

    def flush(self) -> None:
        """Wait until every queued write has landed (or failed)."""
        self._io.queue.join()

    def read(self, slot: int, block_hash: BlockHash, block: int) -> bool:
        """Read ``slot`` into device block ``block``; False (the block's content undefined) when the
        record is not ``block_hash``'s or its bytes fail their CRC."""
        dst = self.device_rows[block] if self._staging is None else self._staging
        if not self._io.read_into(slot, block_hash, dst):
            return False
        if self._staging is not None:
            self.device_rows[block].copy_(self._staging)  # blocking: the staging row is reused next
        return True

    def read_ahead(self, items: list[tuple[int, BlockHash, torch.Tensor]]) -> ReadAhead:
        """Read each ``(slot, block hash, host row)`` on the reader thread; the returned job's
        ``done`` is set once all are over, ``results[i]`` whether row i holds its block."""
        job = ReadAhead(items, [None] * len(items), threading.Event())
        self._io.reads.put(job)
        return job

    def calibrate(self, rounds: int = 3) -> None:
        """Time reading a few blocks into the device pool, cold (out of the page cache where the file
        system has one), at start while every device block is free. The best of ``rounds`` is the
        load cost per block."""
        n = min(8, self.num_slots, len(self.device_rows))
        zero = torch.zeros(self.device_rows.shape[1:], dtype=self.device_rows.dtype)
        key = bytes(16)  # no block's hash: the bookkeeping is empty at start
        for slot in range(n):
            self.write(slot, key, zero)
        self.flush()
        os.fsync(self._fd)
        best = float("inf")
        for _ in range(rounds):
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self._fd, 0, n * self.record_size, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            ok = all(self.read(slot, key, slot) for slot in range(n))
            best = min(best, time.perf_counter() - t0)
            if not ok:
                raise OSError(f"the disk tier's file {self.path} does not read back what was written")
        self.load_s_per_block = best / n

    def close(self) -> None:
        """Stop the writer (queued writes land first), remove the file (and the temporary directory
        made for it). Idempotent."""
        self._closer()


@dataclass(eq=False, slots=True)
class ReadAhead:
    """Records read on the reader thread (``DiskBlocks.read_ahead``)."""

    items: list[tuple[int, BlockHash, torch.Tensor]]  # (slot, block hash, the host row it lands in)
    results: list[bool | None]  # per item, once ``done``: whether the row holds its block
    done: threading.Event


class _FileIO:
    """The threads that write queued records and read records ahead, and what is queued (it holds no
    ``DiskBlocks``, so a tier nobody closed is still collected and closed by its finalizer)."""

    def __init__(self, fd: int, path: str, record_size: int, depth: int) -> None:
        self.fd, self.path, self.record_size = fd, path, record_size
        self.lock = threading.Lock()
        self.latest: dict[int, tuple[BlockHash, torch.Tensor]] = {}  # slot -> its last queued record
        self.failed: list[BlockHash] = []
        self.spare: list[torch.Tensor] = []  # copies whose writes landed, reused (no page faults)
        self.queue: queue.Queue = queue.Queue(depth)
        self.thread = threading.Thread(target=self._run, name="pdserve-kv-disk-writer", daemon=True)
        self.thread.start()
        self.reads: queue.Queue = queue.Queue()
        self.reader = threading.Thread(target=self._read_loop, name="pdserve-kv-disk-reader", daemon=True)
        self.reader.start()

    def read_into(self, slot: int, block_hash: BlockHash, dst: torch.Tensor) -> bool:
        """Read ``slot``'s record into host row ``dst`` (any thread); False when it is not
        ``block_hash``'s or its bytes fail their CRC. A record whose write has not landed comes from
        its queued copy, copied under the lock (once the write lands, its buffer is reused)."""
        with self.lock:
            queued = self.latest.get(slot)
            if queued is not None:
                if queued[0] != block_hash:
                    return False
                dst.copy_(queued[1])
                return True
        data = _bytes(dst)
        header = bytearray(HEADER.size)
        try:
            n = os.preadv(self.fd, [header, data], slot * self.record_size)
        except OSError as exc:
            logger.error("disk tier: reading slot %d of %s failed: %s", slot, self.path, exc)
            return False
        if n != self.record_size:
            return False
        recorded, crc = HEADER.unpack(header)
        return recorded == block_hash and zlib.crc32(data) == crc

    def _read_loop(self) -> None:
        while (job := self.reads.get()) is not None:
            try:
                for i, (slot, block_hash, dst) in enumerate(job.items):
                    job.results[i] = self.read_into(slot, block_hash, dst)
            except Exception:  # a read that did not land is a block recomputed, never a hang
                logger.exception("disk tier: a read ahead failed")
            finally:
                job.done.set()

    def submit(self, slot: int, block_hash: BlockHash, row: torch.Tensor) -> None:
        with self.lock:
            copy = self.spare.pop() if self.spare else torch.empty_like(row)
        record = (block_hash, copy.copy_(row))
        with self.lock:
            self.latest[slot] = record
        self.queue.put((slot, record))  # waits while the queue is full

    def queued(self, slot: int) -> tuple[BlockHash, torch.Tensor] | None:
        with self.lock:
            return self.latest.get(slot)

    def take_failed(self) -> list[BlockHash]:
        if not self.failed:
            return []
        with self.lock:
            failed, self.failed = self.failed, []
        return failed

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            slot, record = item
            try:
                self._write(slot, *record)
            except OSError as exc:
                logger.warning("disk tier: a block was not kept (%s)", exc)
                with self.lock:
                    self.failed.append(record[0])
            with self.lock:  # a later record queued for the slot stays until it lands too
                if self.latest.get(slot) is record:
                    del self.latest[slot]
                self.spare.append(record[1])  # (reads of it ran on the engine's thread, done by now)
            self.queue.task_done()
        self.queue.task_done()

    def _write(self, slot: int, block_hash: BlockHash, row: torch.Tensor) -> None:
        data = _bytes(row)
        header = HEADER.pack(block_hash, zlib.crc32(data))
        written = os.pwritev(self.fd, [header, data], slot * self.record_size)
        if written != self.record_size:
            raise OSError(f"short write to {self.path}: {written} of {self.record_size} bytes")

    def stop(self) -> None:
        for thread, jobs in ((self.reader, self.reads), (self.thread, self.queue)):
            if thread.is_alive():
                jobs.put(None)
                thread.join()


def _close(io: _FileIO, fd: int) -> None:
    if threading.current_thread() in (io.thread, io.reader):
        # The garbage collector ran the finalizer on one of the threads it stops (a tier nobody
        # closed, in a reference cycle): a thread of its own joins them.
        threading.Thread(target=_close, args=(io, fd), daemon=True).start()
        return
    io.stop()
    with contextlib.suppress(OSError):
        os.close(fd)  # the file's last reference: the kernel frees it


def _bytes(t: torch.Tensor):
    """A tensor's bytes as a writable buffer over its memory (a host row; contiguous)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _create_file(directory: str | None, size: int) -> tuple[str, int]:
    """(the path it was made at, fd) of a new file of ``size`` bytes, already unlinked (and the
    temporary directory made for it removed)."""
    tmpdir = None
    if directory is None:
        directory = tmpdir = tempfile.mkdtemp(prefix="pdserve-kv-disk-")
    elif not os.path.isdir(directory):
        raise ValueError(f"kv_disk_cache_dir={directory!r} is not a directory")
    try:
        free = shutil.disk_usage(directory).free
        if free < size:
            raise ValueError(
                f"kv_disk_cache_dir={directory!r} has {free / 2**30:.2f} GiB free; the disk tier "
                f"needs {size / 2**30:.2f} GiB (lower kv_disk_cache_gib or pick another directory)"
            )
        try:
            fd, path = tempfile.mkstemp(prefix="pdserve-kv-", suffix=".blocks", dir=directory)
        except OSError as exc:
            raise ValueError(f"kv_disk_cache_dir={directory!r} is not usable: {exc.strerror}") from exc
        try:
            os.unlink(path)  # nothing but the descriptor keeps it from here on
            os.ftruncate(fd, size)  # sparse: blocks take room as they are written
        except OSError as exc:
            os.close(fd)
            raise ValueError(f"kv_disk_cache_dir={directory!r} is not usable: {exc.strerror}") from exc
    finally:
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)
    return path, fd
