"""The disk tier of the prefix cache: blocks the host tier evicts are written to a bounded file, found
again, read back unchanged (or, when their record fails its check, recomputed), and the file is gone
at shutdown.

Bookkeeping and I/O on real (CPU) tensors standing for the device pool and a real file in a temporary
directory, then the engine: a working set larger than its KV pool and its host tier, greedy output
equal to HF and to the engine without tiers, prefix hits served from disk, every block back in its pool.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import subprocess
import sys
import threading
import zlib

import pytest
import torch
from test_kv_cache_manager import BS, make_request

from engine import LLM, SamplingParams
from engine.block_pool import BlockRemoved, BlockStored
from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.kv_disk_tier import HEADER, DiskBlocks, DiskTier, _FileIO
from engine.kv_host_tier import HostBlocks, HostTier


def _manager(tmp_path, num_blocks: int, host_slots: int, disk_slots: int):
    """A manager over a real block tensor (row b = block b, 4 floats) with a host tier and a disk tier
    (a real file in ``tmp_path``)."""
    kv = KVCacheManager(num_blocks, BS)
    device = torch.zeros(num_blocks, 4)
    kv.attach_host_tier(HostTier(host_slots), HostBlocks(device, host_slots))
    kv.attach_disk_tier(DiskTier(disk_slots), DiskBlocks(device, disk_slots, str(tmp_path)))
    return kv, device


def _compute(kv: KVCacheManager, device: torch.Tensor, req) -> list[int]:
    """Admit ``req`` as the scheduler does and "compute" its prompt: each new block's row gets a value
    derived from its hash; blocks that came from a cache keep theirs. Returns its blocks."""
    hit = kv.find_prefix_hit(req)
    req.num_computed_tokens = hit.num_tokens
    kv.allocate(req, req.num_tokens - hit.num_tokens, hit)
    kv.record_prefix_query(req, hit)
    table = kv.block_ids(req)
    for i in range(req.num_computed_tokens // BS, len(table)):
        device[table[i]] = _content(req, i)
    req.num_computed_tokens = req.num_tokens
    return table


def _content(req, i: int) -> torch.Tensor:
    req.update_block_hashes(BS, "")
    seed = int.from_bytes(req.block_hashes[i][:2], "little") if i < len(req.block_hashes) else -1
    return torch.full((4,), float(seed))


def _spill_a(tmp_path):
    """a's 3 full blocks pushed down by b: the host tier (2 slots) keeps two, the third goes to disk."""
    kv, device = _manager(tmp_path, num_blocks=4, host_slots=2, disk_slots=8)
    a = make_request("a", list(range(3 * BS + 1)))
    _compute(kv, device, a)
    expected = [device[b].clone() for b in kv.block_ids(a)[:3]]
    kv.free(a)
    b = make_request("b", list(range(1000, 1000 + 3 * BS + 1)))
    _compute(kv, device, b)
    kv.free(b)
    return kv, device, a, expected


def test_blocks_the_host_tier_evicts_come_back_from_disk_with_their_content(tmp_path):
    kv, device, a, expected = _spill_a(tmp_path)
    assert len(kv.disk_tier) == 1 and a.block_hashes[2] in kv.disk_tier  # the tail went first
    stored = [e for e in kv.disk_tier.drain_events() if isinstance(e, BlockStored)]
    assert stored == [BlockStored([a.block_hashes[2]], "disk")]

    again = make_request("a2", list(range(3 * BS + 1)))
    hit = kv.find_prefix_hit(again)
    assert (hit.block_ids, len(hit.host_slots), len(hit.disk_slots)) == ([], 2, 1)
    assert hit.num_tokens == 3 * BS
    table = _compute(kv, device, again)
    for i in range(3):  # every block holds a's content, and the device cache knows it again
        assert torch.equal(device[table[i]], expected[i]), i
        assert kv.pool.lookup(again.block_hashes[i]) == table[i]
    assert kv.prefix_hits_disk == BS and kv.prefix_hits_host == 2 * BS and kv.prefix_hits == 3 * BS
    assert kv.disk_tier.counters.loaded_blocks == 1 and a.block_hashes[2] in kv.disk_tier  # kept
    kv.free(again)
    assert kv.num_free_blocks == 4
    kv.close()


@pytest.mark.parametrize("damage", ["bytes", "header"])
def test_a_record_that_fails_its_check_is_recomputed_not_served(tmp_path, damage):
    """The file no longer holds what the bookkeeping says (bytes flipped, or another block's record
    in the slot): the hit stops before that block, it is dropped from the tier, and the step computes
    it (the request's computed tokens go back to where the hit ends)."""
    kv, _, a, _ = _spill_a(tmp_path)
    slot, blocks = kv.disk_tier.lookup(a.block_hashes[2]), kv.disk_blocks
    blocks.flush()  # the record is in the file (until then, reads take its queued copy)
    offset = slot * blocks.record_size
    with open(blocks.open_path, "r+b") as f:
        if damage == "bytes":
            f.seek(offset + HEADER.size)
            f.write(b"\xff" * 4)
        else:  # a sound record, of another block
            f.seek(offset + HEADER.size)
            crc = zlib.crc32(f.read(blocks.record_size - HEADER.size))
            f.seek(offset)
            f.write(HEADER.pack(a.block_hashes[1], crc))
    again = make_request("a2", list(range(3 * BS + 1)))
    hit = kv.find_prefix_hit(again)
    again.num_computed_tokens = hit.num_tokens
    kv.allocate(again, again.num_tokens - hit.num_tokens, hit)
    assert again.num_computed_tokens == hit.num_tokens == 2 * BS and hit.disk_slots == []
    table = kv.block_ids(again)  # the failed block is the step's to compute: fresh, not cached
    assert len(table) == 3 and kv.pool.block_hash[table[2]] is None
    assert kv.pool.lookup(a.block_hashes[2]) is None
    assert a.block_hashes[2] not in kv.disk_tier and kv.disk_tier.counters.rejected_blocks == 1
    assert BlockRemoved([a.block_hashes[2]], "disk") in kv.disk_tier.drain_events()
    kv.free(again)
    assert kv.num_free_blocks == 4
    kv.close()


def test_slots_being_read_are_not_reused_by_the_same_admissions_writes(tmp_path):
    """A disk tier of one slot holding a's third block, a's first two in the host tier with x's block.
    Loading a again evicts device blocks into the host tier, which evicts x's block (unpinned) towards
    disk: the only disk slot is pinned by the read, so that write is dropped, not put over a's block."""
    kv, device = _manager(tmp_path, num_blocks=4, host_slots=3, disk_slots=1)
    a = make_request("a", list(range(3 * BS + 1)))
    _compute(kv, device, a)
    expected = [device[b].clone() for b in kv.block_ids(a)[:3]]
    kv.free(a)
    for rid, n, first in (("x", 1, 500), ("y", 2, 600), ("z", 1, 700)):  # push a down, a2 to disk
        r = make_request(rid, list(range(first, first + n * BS + 1)))
        _compute(kv, device, r)
        kv.free(r)
    assert kv.disk_tier.hashes() == [a.block_hashes[2]] and len(kv.host_tier) == 3
    table = _compute(kv, device, make_request("a2", list(range(3 * BS + 1))))
    assert all(torch.equal(device[table[i]], expected[i]) for i in range(3))
    counters = kv.disk_tier.counters
    assert counters.loaded_blocks == 1 and counters.rejected_blocks == 0 and counters.dropped_offloads >= 1
    kv.close()


def test_the_file_is_bounded_and_unlinked_from_the_start(tmp_path):
    device = torch.zeros(4, 4)
    blocks = DiskBlocks(device, 3, str(tmp_path))
    assert os.path.getsize(blocks.open_path) == 3 * blocks.record_size  # its bound, from the start
    assert os.listdir(tmp_path) == [] and not os.path.exists(blocks.path)  # only its descriptor holds it
    blocks.close()
    blocks.close()  # idempotent
    assert tmp_path.is_dir() and not blocks._io.thread.is_alive()  # a given directory stays


@pytest.mark.parametrize("given_directory", [True, False])
def test_a_killed_process_leaves_no_file_behind(tmp_path, given_directory):
    """SIGKILL (an OOM kill, a crash loop) runs no finalizer: the file, unlinked at creation, goes
    with the process; the default temporary directory is gone too."""
    directory = str(tmp_path) if given_directory else None
    code = (
        "import sys, tempfile, torch; from engine.kv_disk_tier import DiskBlocks;"
        f"tempfile.tempdir = {str(tmp_path)!r}; b = DiskBlocks(torch.zeros(4, 4), 3, {directory!r});"
        "b.write(0, bytes(16), torch.ones(4)); b.flush(); print('ready', flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        assert os.listdir(tmp_path) == []  # nothing named, while it runs
    finally:
        child.kill()
        child.wait(30)
    assert os.listdir(tmp_path) == []


@pytest.fixture
def writes_held(monkeypatch):
    """The writer thread waits before each write until the event is set."""
    gate = threading.Event()
    write = _FileIO._write

    def held(self, *args):
        gate.wait(60)  # (bounded: a test that waits on a write it should not wait on fails, not hangs)
        write(self, *args)

    monkeypatch.setattr(_FileIO, "_write", held)
    yield gate
    gate.set()


def _record_hash(blocks: DiskBlocks, slot: int) -> bytes:
    with open(blocks.open_path, "rb") as f:
        f.seek(slot * blocks.record_size)
        return HEADER.unpack(f.read(HEADER.size))[0]


def test_writes_leave_the_engine_thread_and_reads_see_them_at_once(tmp_path, writes_held):
    """A write returns while the disk has not got it (the writer thread is held); reading its slot
    meanwhile gets the queued copy, the latest one queued for the slot; once the writes land, the file
    holds the latest and reads come from it."""
    device = torch.zeros(4, 4)
    blocks = DiskBlocks(device, 3, str(tmp_path))
    h1, h2 = b"1" * 16, b"2" * 16
    blocks.write(0, h1, torch.full((4,), 1.0))
    assert _record_hash(blocks, 0) == bytes(16)  # not on disk yet
    assert blocks.read(0, h1, 2) and torch.equal(device[2], torch.full((4,), 1.0))
    blocks.write(0, h2, torch.full((4,), 2.0))  # the slot reused while its first write waits
    assert not blocks.read(0, h1, 3)  # the slot holds h2 now
    assert blocks.read(0, h2, 3) and torch.equal(device[3], torch.full((4,), 2.0))
    writes_held.set()
    blocks.flush()
    assert _record_hash(blocks, 0) == h2 and blocks._io.latest == {}
    device.zero_()
    assert blocks.read(0, h2, 1) and torch.equal(device[1], torch.full((4,), 2.0))  # from the file
    blocks.close()


def test_a_failed_write_is_forgotten_and_never_served(tmp_path, monkeypatch):
    """Writes fail on the writer thread (the disk is full): the next spill forgets the blocks they
    held, and a read of such a slot before that fails its check, so the block is recomputed."""

    def full(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    kv, device, a, expected = _spill_a(tmp_path)
    kv.disk_blocks.flush()
    lost = a.block_hashes[2]
    assert lost in kv.disk_tier  # the tier does not know yet
    again = make_request("a2", list(range(3 * BS + 1)))
    table = _compute(kv, device, again)  # reads the slot: not a's block, computed instead
    assert lost not in kv.disk_tier and kv.disk_tier.counters.rejected_blocks == 1
    assert all(torch.equal(device[table[i]], expected[i]) for i in range(3))
    kv.free(again)
    c = make_request("c", list(range(2000, 2000 + 3 * BS + 1)))  # more spills, their writes fail too
    _compute(kv, device, c)
    kv.free(c)
    kv.disk_blocks.flush()
    failed = set(kv.disk_blocks._io.failed)
    assert failed and failed <= set(kv.disk_tier.hashes())
    kv.disk_tier.drain_events()
    d = make_request("d", list(range(3000, 3000 + 3 * BS + 1)))
    _compute(kv, device, d)  # its first spill forgets them (a later one may store one of them again)
    removed = {h for e in kv.disk_tier.drain_events() if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert failed <= removed
    kv.free(d)
    assert kv.num_free_blocks == 4
    kv.close()


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(length)] for _ in range(n)]


def _gib(blocks: int, block_bytes: int) -> float:
    return blocks * block_bytes / 2**30


COMMON = dict(block_size=8, num_blocks=16, max_num_seqs=1)


def test_engine_serves_an_overflowing_working_set_from_disk(tiny_llama, hf_greedy, tmp_path):
    """Six 72-token prompts (9 blocks each) against a pool of 16 blocks and a host tier of 12: the
    second round finds most prefixes on disk. Output equals HF's and the tierless engine's."""
    prompts = _prompts(6, 72, seed=7)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = LLM(str(tiny_llama), **COMMON)
    block_bytes = plain.core.layout.block_bytes
    tiered = LLM(
        str(tiny_llama),
        kv_host_cache_gib=_gib(12, block_bytes),
        kv_disk_cache_gib=_gib(100, block_bytes + HEADER.size),
        kv_disk_cache_dir=str(tmp_path),
        **COMMON,
    )
    for round_ in range(2):
        for llm in (plain, tiered):
            outs = llm.generate(prompts, params, use_tqdm=False)
            for p, o in zip(prompts, outs):
                assert o.token_ids == hf_greedy(tiny_llama, p, 6), round_
    stats = tiered.stats()
    assert plain.stats().prefix_cache_hits == 0  # the pool cannot keep them
    assert stats.prefix_cache_hits == 6 * 64  # 8 of 9 blocks each, from one tier or another
    assert stats.prefix_cache_hits_disk > 0  # LRU over a cycle: the host tier holds the wrong ones
    assert stats.disk_written_blocks > 0 and 0 < stats.disk_cache_used <= stats.disk_cache_blocks == 100
    assert stats.disk_rejected_blocks == 0 and stats.num_free_blocks == stats.num_blocks
    # What the router weighs a disk hit by, measured; without a tier it is worth nothing.
    assert 0 <= tiered.core.disk_hit_cost_pct() < 100 and plain.core.disk_hit_cost_pct() == 100
    path = tiered.core.kv.disk_blocks.path
    assert os.path.dirname(path) == str(tmp_path) and not os.path.exists(path)  # unlinked at once
    tiered.close()
    assert tmp_path.is_dir()


def test_a_damaged_file_changes_no_output(tiny_llama, tmp_path):
    """Every record on disk damaged between two rounds: none of them is served (blocks written after
    the damage may be), what they held is recomputed, and the output is the same."""
    prompts = _prompts(6, 72, seed=11)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    block_bytes = LLM(str(tiny_llama), **COMMON).core.layout.block_bytes
    llm = LLM(str(tiny_llama), kv_host_cache_gib=_gib(12, block_bytes), kv_disk_cache_gib=0.001, **COMMON)
    first = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    blocks = llm.core.kv.disk_blocks
    blocks.flush()
    with open(blocks.open_path, "r+b") as f:
        for slot in range(blocks.num_slots):
            f.seek(slot * blocks.record_size + HEADER.size)
            f.write(b"\x7f" * 8)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == first
    stats = llm.stats()
    assert stats.disk_rejected_blocks > 0
    assert stats.num_free_blocks == stats.num_blocks
    llm.close()


def test_the_directory_holds_no_more_than_its_bound(tiny_llama, tmp_path):
    """A disk tier of 8 blocks under an overflowing working set: LRU evicts, the file never grows."""
    block_bytes = LLM(str(tiny_llama), **COMMON).core.layout.block_bytes
    budget = 8 * (block_bytes + HEADER.size)
    llm = LLM(
        str(tiny_llama),
        kv_host_cache_gib=_gib(4, block_bytes),
        kv_disk_cache_gib=budget / 2**30,
        kv_disk_cache_dir=str(tmp_path),
        **COMMON,
    )
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for seed in range(3):
        llm.generate(_prompts(6, 72, seed=seed), params, use_tqdm=False)
    tier = llm.core.kv.disk_tier
    assert tier.num_slots == 8 and len(tier) == 8 and tier.counters.evicted_blocks > 0
    assert os.listdir(tmp_path) == []  # unlinked at creation
    st = os.stat(llm.core.kv.disk_blocks.open_path)
    assert st.st_size <= budget and st.st_blocks * 512 <= budget + st.st_blksize  # a file system block
    llm.close()
    assert os.listdir(tmp_path) == []


def test_the_default_directory_is_temporary_and_removed(tiny_llama):
    llm = LLM(str(tiny_llama), kv_host_cache_gib=0.0001, kv_disk_cache_gib=0.001, **COMMON)
    blocks = llm.core.kv.disk_blocks
    path, fd_path = blocks.path, blocks.open_path
    directory = os.path.dirname(path)
    assert os.path.basename(directory).startswith("pdserve-kv-disk-")
    assert not os.path.exists(directory) and os.path.exists(fd_path)  # gone already; the fd holds the file
    fd = blocks._fd
    del llm, blocks
    gc.collect()  # nobody called close(): the engine's end closes it anyway
    with pytest.raises(OSError):
        os.fstat(fd)


@pytest.mark.parametrize(
    "where, error",
    [("missing", "is not a directory"), ("file", "is not a directory"), ("/proc", "GiB free|not usable")],
)
def test_an_unusable_directory_fails_the_start_clearly(tiny_llama, tmp_path, where, error):
    directory = {"missing": str(tmp_path / "nope"), "file": str(tmp_path / "f"), "/proc": "/proc"}[where]
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match=f"kv_disk_cache_dir={directory!r}.*({error})"):
        LLM(str(tiny_llama), kv_host_cache_gib=0.0001, kv_disk_cache_gib=0.001, kv_disk_cache_dir=directory)


def test_disk_tier_options_are_validated():
    with pytest.raises(ValueError, match="kv_disk_cache_gib must be"):
        EngineConfig(model="m", kv_host_cache_gib=1, kv_disk_cache_gib=-1)
    with pytest.raises(ValueError, match="kv_disk_cache_gib needs a host tier"):
        EngineConfig(model="m", kv_disk_cache_gib=1)
    with pytest.raises(ValueError, match="kv_disk_cache_dir is set but the disk tier is off"):
        EngineConfig(model="m", kv_disk_cache_dir="/tmp")


def test_the_registry_hears_of_the_disk_tier(tiny_llama):
    from registry.schema import DISK_STORED, HOST_REMOVED, HOST_STORED
    from worker.registry_link import event_batches

    block_bytes = LLM(str(tiny_llama), **COMMON).core.layout.block_bytes
    llm = LLM(str(tiny_llama), kv_host_cache_gib=_gib(4, block_bytes), kv_disk_cache_gib=0.001, **COMMON)
    llm.core.drain_kv_events()  # subscribe
    llm.generate(_prompts(6, 40, seed=5), SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    kinds = {kind for kind, _ in event_batches(llm.core.drain_kv_events())}
    assert {HOST_STORED, HOST_REMOVED, DISK_STORED} <= kinds
    *_, disk = llm.core.cached_hashes()
    assert set(disk) == set(llm.core.kv.disk_tier.hashes()) and len(disk) == len(llm.core.kv.disk_tier) > 0
    llm.close()


def test_disk_hits_reach_status_and_metrics(tiny_llama):
    from prometheus_client.parser import text_string_to_metric_families

    from cli.status import format_status
    from ingress.metrics import IngressMetrics
    from proto import pdserve_pb2 as pb
    from worker.state import stats_from_proto, stats_to_proto

    block_bytes = LLM(str(tiny_llama), **COMMON).core.layout.block_bytes
    llm = LLM(str(tiny_llama), kv_host_cache_gib=_gib(4, block_bytes), kv_disk_cache_gib=0.001, **COMMON)
    prompts = _prompts(6, 40, seed=3)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    assert stats.prefix_cache_hits_disk > 0
    assert stats_from_proto(stats_to_proto(stats)) == dataclasses.replace(stats, num_swap_outs=0)
    worker = pb.WorkerState(role="prefill", worker_id="p0", stats=stats_to_proto(stats))

    lines = format_status(pb.ClusterState(policy="cache_aware"), [worker]).splitlines()
    head = lines[lines.index("prefix cache by tier:") + 1].split("  ")
    row = lines[lines.index("prefix cache by tier:") + 2].split()
    assert [h.strip() for h in head if h.strip()][-5:-2] == ["DISK HITS", "DISK TIER USED", "WRITTEN"]
    assert row[-6:-2] == [
        str(stats.prefix_cache_hits_disk),
        f"({stats.prefix_cache_hits_disk / stats.prefix_cache_queries:.0%})",
        f"{stats.disk_cache_used}/{stats.disk_cache_blocks}",
        str(stats.disk_written_blocks),
    ]

    rendered = IngressMetrics("m").render(None, [worker], ("i0", 0, 0)).decode()
    samples = {
        (s.name, s.labels.get("tier")): s.value
        for f in text_string_to_metric_families(rendered)
        for s in f.samples
        if s.labels.get("worker") == "p0"
    }
    assert samples[("pdserve_prefix_cache_tier_hits_total", "disk")] == stats.prefix_cache_hits_disk
    assert samples[("pdserve_prefix_cache_tier_hits_total", "device")] == (
        stats.prefix_cache_hits - stats.prefix_cache_hits_host - stats.prefix_cache_hits_disk
    )
    assert samples[("pdserve_kv_disk_blocks_used", None)] == stats.disk_cache_used
    assert samples[("pdserve_kv_disk_written_blocks_total", None)] == stats.disk_written_blocks
    llm.close()


def test_closed_from_one_of_its_own_threads(tmp_path, monkeypatch):
    """The garbage collector may run a forgotten tier's finalizer on the tier's reader or writer
    thread: the file is still removed and both threads end (a thread cannot join itself)."""
    import time

    device = torch.zeros(4, 4)
    blocks = DiskBlocks(device, 3, str(tmp_path))
    io = blocks._io

    def close_here(self, *args):
        blocks._closer()  # what a collection on this thread would run
        return False

    monkeypatch.setattr(_FileIO, "read_into", close_here)
    job = blocks.read_ahead([(0, bytes(16), torch.zeros(4))])
    assert job.done.wait(30)
    deadline = time.monotonic() + 30
    while os.listdir(tmp_path) or io.thread.is_alive() or io.reader.is_alive():
        assert time.monotonic() < deadline, (os.listdir(tmp_path), io.thread, io.reader)
        time.sleep(0.01)
