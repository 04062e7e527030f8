"""The in-process KV transfer backend behaves like the NIXL one: data lands in the right blocks, the
owner is notified once it has, failures and time-outs report FAILED, and a timed-out read keeps its
local blocks exposed until it ends."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from kv_transfer import (
    InProcessBackend,
    InProcessFabric,
    KVCompat,
    KVIncompatibleError,
    KVTransferBackend,
    TransferState,
)

COMPAT = KVCompat(model="tiny", dtype="float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
NUM_BLOCKS = 8


def _kv(pattern: bool) -> torch.Tensor:
    shape = (NUM_BLOCKS, COMPAT.num_layers, 2, COMPAT.block_size, COMPAT.num_kv_heads, COMPAT.head_dim)
    if not pattern:
        return torch.zeros(shape)
    # Every block distinct: block b holds values b*1000 + offset.
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 1


@pytest.fixture
def pair():
    """(fabric, owner with patterned blocks, reader with zeroed blocks that has added the owner)."""
    fabric = InProcessFabric()
    owner = InProcessBackend(fabric, "owner", _kv(True), COMPAT)
    reader = InProcessBackend(fabric, "reader", _kv(False), COMPAT)
    reader.add_peer(owner.local_info())
    owner.add_peer(reader.local_info())
    yield fabric, owner, reader
    reader.close()
    owner.close()


def _wait_until_past(deadline: float) -> None:
    """Wait for the monotonic clock to pass a transfer's deadline (a condition, not a guess)."""
    while time.monotonic() < deadline:
        time.sleep(0.001)


def test_implements_the_interface():
    assert issubclass(InProcessBackend, KVTransferBackend)


def test_read_copies_non_contiguous_blocks_and_notifies_the_owner(pair):
    _, owner, reader = pair
    remote, local = [5, 1, 2, 7], [0, 6, 3, 4]
    h = reader.start_read("owner", remote, local, b"req-1", timeout_s=5)
    assert owner.get_notifications() == []  # nothing landed before the reader polls
    assert reader.poll(h) is TransferState.DONE and h.local_blocks_reusable
    for r, lo in zip(remote, local):
        assert torch.equal(reader.kv[lo], owner.kv[r])
    untouched = [b for b in range(NUM_BLOCKS) if b not in local]
    assert not reader.kv[untouched].any()
    assert owner.get_notifications() == [("reader", b"req-1")]
    assert owner.get_notifications() == []
    assert h.num_bytes == 4 * reader.block_bytes
    reader.release(h)
    assert reader.in_flight == 0


def test_empty_read_is_done_at_once_and_still_notifies(pair):
    _, owner, reader = pair
    h = reader.start_read("owner", [], [], b"all-hits", timeout_s=5)
    assert h.state is TransferState.DONE and h.local_blocks_reusable
    assert owner.get_notifications() == [("reader", b"all-hits")]


def test_send_notification_outside_a_transfer(pair):
    _, owner, reader = pair
    reader.send_notification("owner", b"free r1")
    owner.send_notification("reader", b"hello")
    assert owner.get_notifications() == [("reader", b"free r1")]
    assert reader.get_notifications() == [("owner", b"hello")]
    with pytest.raises(ValueError, match="unknown peer"):
        reader.send_notification("nobody", b"x")


@pytest.mark.parametrize(
    "remote,local,timeout,problem",
    [
        ([0, 1], [0], 5, "remote block ids but"),
        ([NUM_BLOCKS], [0], 5, "out of range"),
        ([0], [-1], 5, "out of range"),
        ([0, 1], [2, 2], 5, "repeat"),
        ([0], [0], 0, "timeout_s"),
    ],
    ids=["length", "remote-range", "local-range", "repeat", "timeout"],
)
def test_bad_reads_are_caller_errors(pair, remote, local, timeout, problem):
    _, _, reader = pair
    with pytest.raises(ValueError, match=problem):
        reader.start_read("owner", remote, local, b"x", timeout_s=timeout)
    with pytest.raises(ValueError, match="unknown peer"):
        reader.start_read("nobody", [0], [0], b"x", timeout_s=5)


def test_incompatible_peer_is_refused():
    fabric = InProcessFabric()
    with InProcessBackend(fabric, "reader", _kv(False), COMPAT) as reader:
        other = dataclasses.replace(COMPAT, block_size=8)
        shape = (2, other.num_layers, 2, other.block_size, other.num_kv_heads, other.head_dim)
        with InProcessBackend(fabric, "owner", torch.zeros(shape), other) as owner:
            with pytest.raises(KVIncompatibleError, match="block_size 4 != 8"):
                reader.add_peer(owner.local_info())
            with pytest.raises(ValueError, match="unknown peer"):
                reader.start_read("owner", [0], [0], b"x", timeout_s=5)


def test_kv_tensor_must_match_its_compat():
    with pytest.raises(ValueError, match="does not match its KVCompat"):
        InProcessBackend(InProcessFabric(), "a", torch.zeros(4, 3, 2, 4, 2, 8), COMPAT)


def test_injected_transport_error_fails_and_settles(pair):
    fabric, owner, reader = pair
    fabric.fail_next_reads(1)
    h = reader.start_read("owner", [1], [1], b"r", timeout_s=5)
    assert reader.poll(h) is TransferState.FAILED
    assert h.local_blocks_reusable and "transport error" in h.error
    assert not reader.kv.any() and owner.get_notifications() == []
    # Only the next read was doomed.
    h2 = reader.start_read("owner", [1], [1], b"r2", timeout_s=5)
    assert reader.poll(h2) is TransferState.DONE


def test_stalled_read_times_out_unsettled_then_lands_when_resumed(pair):
    fabric, owner, reader = pair
    fabric.stall_reads()
    h = reader.start_read("owner", [3, 4], [0, 1], b"slow", timeout_s=0.05)
    assert reader.poll(h) is TransferState.IN_PROGRESS
    _wait_until_past(h.deadline)
    assert reader.poll(h) is TransferState.FAILED and h.error == "timed out"
    assert not h.local_blocks_reusable
    reader.release(h)  # released in flight: still exposed
    assert not h.local_blocks_reusable and reader.in_flight == 1
    fabric.resume_reads()
    assert owner.get_notifications() == []  # the reader has not called in since
    assert reader.poll(h) is TransferState.FAILED  # the state stays FAILED ...
    assert h.local_blocks_reusable  # ... but the read has ended: the data landed
    assert torch.equal(reader.kv[0], owner.kv[3]) and torch.equal(reader.kv[1], owner.kv[4])
    assert owner.get_notifications() == [("reader", b"slow")]
    assert reader.in_flight == 0


def test_stalled_read_settles_when_the_owner_dies_not_when_removed(pair):
    fabric, owner, reader = pair
    fabric.stall_reads()
    h = reader.start_read("owner", [2], [2], b"r", timeout_s=5)
    reader.remove_peer("owner")
    assert reader.poll(h) is TransferState.FAILED and h.error == "peer removed"
    assert not h.local_blocks_reusable  # as over UCX: removing a peer does not fence its reads
    owner.close()
    reader.poll(h)
    assert h.local_blocks_reusable and not reader.kv.any()


def test_closing_the_reader_fences_its_reads(pair):
    fabric, _, reader = pair
    fabric.stall_reads()
    h = reader.start_read("owner", [2], [2], b"r", timeout_s=5)
    reader.close()
    assert h.state is TransferState.FAILED and h.local_blocks_reusable
    with pytest.raises(RuntimeError, match="closed"):
        reader.start_read("owner", [2], [2], b"r", timeout_s=5)


def test_agent_names_are_unique_on_a_fabric(pair):
    fabric, _, _ = pair
    with pytest.raises(ValueError, match="already on this fabric"):
        InProcessBackend(fabric, "owner", _kv(False), COMPAT)
