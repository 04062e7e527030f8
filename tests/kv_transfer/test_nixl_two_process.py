"""Real NIXL READs over UCX between two processes, on plain memory.

Each test drives an owner and a reader (``nixl_agent_server``) through commands; only plain
values cross the process boundary. Covers the read itself (merged runs plus a single block), the
owner's notification, failures (an exited peer, a stalled peer past its deadline), and what
happens to the local blocks of a timed-out read.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from nixl_agent_server import COMPAT, NUM_BLOCKS, RemoteError, block_pattern

pytestmark = pytest.mark.timeout(60)

BLOCK_FLOATS = 2 * 2 * 4 * 2 * 8


def expected_blocks(ids: list[int]) -> bytes:
    return block_pattern(NUM_BLOCKS, BLOCK_FLOATS)[ids].numpy().tobytes()


def as_floats(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.float32).reshape(-1, BLOCK_FLOATS)


def test_read_scattered_blocks_and_notify_owner(owner_and_reader):
    owner, reader, _ = owner_and_reader
    # 3-5 -> 0-2 is one merged run, 9 -> 7 a single block
    result = reader.call("read", "owner", [3, 4, 5, 9], [0, 1, 2, 7], b"req-42:done", 10.0, 20.0)
    assert result["state"] == "done", result
    assert result["error"] is None and result["reusable"]
    assert reader.call("blocks", [0, 1, 2, 7]) == expected_blocks([3, 4, 5, 9])
    untouched = [b for b in range(NUM_BLOCKS) if b not in (0, 1, 2, 7)]
    assert not as_floats(reader.call("blocks", untouched)).any()
    assert owner.call("notifications", 1, 10.0) == [("reader", b"req-42:done")]
    # the owner's memory is unchanged by being read
    assert owner.call("blocks", list(range(NUM_BLOCKS))) == expected_blocks(list(range(NUM_BLOCKS)))


def test_repeated_reads_and_empty_read_notify(owner_and_reader):
    owner, reader, owner_info = owner_and_reader
    reader.call("add_peer", owner_info)  # idempotent
    first = reader.call("read", "owner", [15, 0], [15, 14], b"a", 10.0, 20.0)
    second = reader.call("read", "owner", [6, 7, 8, 9, 10, 11], [3, 4, 5, 6, 7, 8], b"b", 10.0, 20.0)
    empty = reader.call("read", "owner", [], [], b"c", 10.0, 20.0)  # all prefix hits: nothing to move
    assert [r["state"] for r in (first, second, empty)] == ["done"] * 3
    assert reader.call("blocks", [15, 14, 3, 4, 5, 6, 7, 8]) == expected_blocks([15, 0, 6, 7, 8, 9, 10, 11])
    notes = owner.call("notifications", 3, 10.0)
    assert sorted(notes) == [("reader", b"a"), ("reader", b"b"), ("reader", b"c")]


def test_bad_requests_raise_clear_errors(owner_and_reader):
    _, reader, _ = owner_and_reader
    with pytest.raises(RemoteError, match="unknown peer 'nobody'"):
        reader.call("start_read", "nobody", [0], [0], b"", 1.0)
    with pytest.raises(RemoteError, match=r"remote block ids \[16\] out of range"):
        reader.call("start_read", "owner", [16], [0], b"", 1.0)
    with pytest.raises(RemoteError, match="local block ids repeat"):
        reader.call("start_read", "owner", [1, 2], [0, 0], b"", 1.0)
    with pytest.raises(RemoteError, match="2 remote block ids but 1 local"):
        reader.call("start_read", "owner", [1, 2], [0], b"", 1.0)


def test_incompatible_peer_is_rejected_on_add(owner_and_reader):
    _, reader, owner_info = owner_and_reader
    other = {**owner_info, "agent_name": "other", "compat": {**COMPAT, "dtype": "bfloat16", "block_size": 8}}
    with pytest.raises(RemoteError) as err:
        reader.call("add_peer", other)
    assert err.value.kind == "KVIncompatibleError"
    assert (
        err.value.message == "cannot pull KV from worker other: dtype float32 != bfloat16, block_size 4 != 8"
    )
    with pytest.raises(RemoteError, match="unknown peer 'other'"):
        reader.call("start_read", "other", [0], [0], b"", 1.0)


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_read_from_exited_peer_fails_fast(spawn_agents, warm):
    owner, reader = spawn_agents(), spawn_agents()
    owner_info = owner.call("init", "owner", NUM_BLOCKS, COMPAT, "pattern")
    reader.call("init", "reader", NUM_BLOCKS, COMPAT, "zeros")
    reader.call("add_peer", owner_info)
    if warm:  # connected before the owner goes away
        assert reader.call("read", "owner", [1], [1], b"", 10.0, 20.0)["state"] == "done"
    owner.stop()
    assert owner.process.exitcode is not None
    result = reader.call("read", "owner", [3, 4, 5, 9], [0, 1, 2, 7], b"never", 0.5, 10.0)
    assert result["state"] == "failed", result
    assert result["reusable"], "an errored read is over: its blocks may be reused"
    assert "RemoteDisconnect" in result["error"], result
    assert not as_floats(reader.call("blocks", [0, 2, 7])).any()


def stalled_pair(spawn_agents):
    """Owner and reader on UCX over TCP, where a read needs the owner's process to run."""
    tcp = {"UCX_TLS": "tcp"}
    owner, reader = spawn_agents(tcp), spawn_agents(tcp)
    owner_info = owner.call("init", "owner", NUM_BLOCKS, COMPAT, "pattern")
    reader.call("init", "reader", NUM_BLOCKS, COMPAT, "zeros")
    reader.call("add_peer", owner_info)
    assert reader.call("read", "owner", [0], [15], b"warm", 10.0, 20.0)["state"] == "done"
    assert owner.call("notifications", 1, 10.0) == [("reader", b"warm")]
    stop_process(owner.pid)
    return owner, reader


def stop_process(pid: int) -> None:
    """SIGSTOP, then wait until the kernel reports the process stopped (delivery is asynchronous)."""
    os.kill(pid, signal.SIGSTOP)
    for _ in range(5000):
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(0.001)
    raise TimeoutError(f"process {pid} did not stop")


def test_stalled_peer_times_out_and_late_bytes_are_fenced(spawn_agents):
    owner, reader = stalled_pair(spawn_agents)
    try:
        timed_out = reader.call("read", "owner", [3, 4, 5], [0, 1, 2], b"late", 0.3, 10.0)
        assert timed_out["state"] == "failed" and timed_out["error"] == "timed out", timed_out
        assert not timed_out["reusable"], "NIXL cannot abort the read: its blocks must stay fenced"
        released = reader.call("start_read", "owner", [9], [7], b"released", 30.0)
        after_release = reader.call("release", released)
        assert after_release["state"] == "failed" and not after_release["reusable"]
    finally:
        os.kill(owner.pid, signal.SIGCONT)
    # The owner runs again: both requests end, their bytes land, and only now are the blocks free.
    for handle_id in (timed_out["id"], released):
        settled = reader.call("wait", handle_id, "reusable", 10.0)
        assert settled["state"] == "failed" and settled["reusable"], settled
    assert reader.call("blocks", [0, 1, 2, 7]) == expected_blocks([3, 4, 5, 9])
    assert sorted(owner.call("notifications", 2, 10.0)) == [("reader", b"late"), ("reader", b"released")]


def test_stalled_peer_that_dies_frees_the_fenced_blocks(spawn_agents):
    owner, reader = stalled_pair(spawn_agents)
    try:
        timed_out = reader.call("read", "owner", [3, 4, 5], [0, 1, 2], b"late", 0.3, 10.0)
        assert timed_out["state"] == "failed" and not timed_out["reusable"], timed_out
    finally:
        owner.process.kill()
        owner.process.join(5)
    settled = reader.call("wait", timed_out["id"], "reusable", 10.0)
    assert settled["reusable"], settled
    assert not as_floats(reader.call("blocks", [0, 1, 2])).any()


def test_removing_a_peer_in_flight_keeps_its_read_tracked(spawn_agents):
    owner, reader = stalled_pair(spawn_agents)
    try:
        handle_id = reader.call("start_read", "owner", [3, 4, 5], [0, 1, 2], b"removed", 30.0)
        reader.call("remove_peer", "owner")
        removed = reader.call("wait", handle_id, "terminal", 0)
        assert removed["state"] == "failed" and removed["error"] == "peer removed", removed
        assert not removed["reusable"]
        with pytest.raises(RemoteError, match="unknown peer 'owner'"):
            reader.call("start_read", "owner", [0], [0], b"", 1.0)
    finally:
        os.kill(owner.pid, signal.SIGCONT)
    # NIXL still knows the removed peer until its read ends, so the end is seen and the blocks free
    assert reader.call("wait", handle_id, "reusable", 10.0)["reusable"]
    assert owner.call("notifications", 1, 10.0) == [("reader", b"removed")]


def test_close_fences_a_stalled_read(spawn_agents):
    owner, reader = stalled_pair(spawn_agents)
    try:
        timed_out = reader.call("read", "owner", [3, 4, 5], [0, 1, 2], b"late", 0.3, 10.0)
        assert timed_out["state"] == "failed" and not timed_out["reusable"], timed_out
        reader.call("close")  # destroys the UCX worker: the request can never complete now
        assert reader.call("wait", timed_out["id"], "reusable", 0)["reusable"]
    finally:
        os.kill(owner.pid, signal.SIGCONT)
    assert owner.call("notifications", 1, 1.0) == []  # the owner ran again: nothing was read
    assert not as_floats(reader.call("blocks", [0, 1, 2])).any()


def test_a_read_moves_while_the_owners_engine_thread_is_busy(spawn_agents):
    """Over TCP a READ moves only while the owner calls into NIXL. An engine thread does between
    steps; during a step (this owner's command loop waiting on its pipe, calling nothing) only the
    backend's own progress thread can: with it the read lands, and its notification is kept."""
    tcp, no_thread = {"UCX_TLS": "tcp"}, {"progress_thread": False}
    owner, reader = spawn_agents(tcp), spawn_agents(tcp)
    owner_info = owner.call("init", "owner", NUM_BLOCKS, COMPAT, "pattern", no_thread)
    reader.call("init", "reader", NUM_BLOCKS, COMPAT, "zeros", no_thread)
    reader.call("add_peer", owner_info)
    # Without it, a read of the idle owner waits (here until its deadline).
    stalled = reader.call("read", "owner", [1], [9], b"stalled", 0.5, 10.0)
    assert stalled["state"] == "failed" and "timed out" in stalled["error"], stalled
    owner.call("keep_progressing")
    result = reader.call("read", "owner", [3, 5, 6], [0, 1, 2], b"held", 20.0, 30.0)
    assert result["state"] == "done", result
    assert reader.call("blocks", [0, 1, 2]) == expected_blocks([3, 5, 6])
    # The stalled read settled too once the owner moved; both notifications reached the owner.
    assert sorted(owner.call("notifications", 2, 10.0)) == [("reader", b"held"), ("reader", b"stalled")]
