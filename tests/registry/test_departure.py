"""A worker that deregisters (a drain, a scale-down) leaves the router's view at once, while one whose
record merely vanished (a Redis restarted empty, a missed heartbeat) is kept for the grace period."""

from __future__ import annotations

import time

import pytest

from registry.cluster_view import ClusterView
from registry.registration import WorkerRegistration
from registry.schema import WorkerRecord, connect, worker_key

LONG_GRACE_S = 600.0  # far beyond every wait below: only the left marker can drop a worker in time


def _wait_until(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def _register(client, wid: str, epoch: int = 1) -> WorkerRegistration:
    reg = WorkerRegistration(
        client, WorkerRecord(worker_id=wid, role="decode", address="127.0.0.1:1", epoch=epoch)
    )
    reg.register([])
    return reg


def test_deregistered_worker_leaves_at_once_and_vanished_one_waits_out_the_grace(redis_server):
    client = connect(redis_server.url)
    leaving, vanishing, staying = (_register(client, w) for w in ("d-leaving", "d-vanishing", "d-staying"))
    view = ClusterView(redis_server.url, poll_s=0.05, grace_s=LONG_GRACE_S)
    view.start()
    try:
        _wait_until(lambda: len(view.live_workers()) == 3, "all three are seen")
        leaving.deregister()
        client.delete(worker_key("d-vanishing"))  # as if Redis lost it: no deregistration
        _wait_until(lambda: "d-leaving" not in view.workers, "the deregistered worker is dropped")
        polls = view.last_sync
        _wait_until(lambda: view.last_sync > polls + 0.2, "a few more polls")
        assert {w.worker_id for w in view.live_workers()} == {"d-vanishing", "d-staying"}
        # The same id registering again (a restart) clears its departure.
        _register(client, "d-leaving", epoch=2)
        _wait_until(lambda: "d-leaving" in view.workers, "the restarted worker is back")
        assert view.workers["d-leaving"].epoch == 2
        del vanishing, staying
    finally:
        view.stop()


def test_an_older_incarnation_that_comes_back_leaves_the_id_to_its_replacement(redis_server):
    """A worker stopped (SIGSTOP, a network cut) while a replacement registered under its id, then
    continued: its heartbeats, events and registrations raise ``SupersededError`` instead of
    overwriting the replacement's record every second (the router sent traffic to the old address),
    and its leaving deletes nothing of the replacement's (the router said "no decode worker")."""
    from registry.publisher import RegistryPublisher
    from registry.registration import SupersededError
    from registry.schema import STORED, read_snapshot, read_workers

    client = connect(redis_server.url)
    old = _register(client, "d0", epoch=1)
    new = WorkerRegistration(
        client, WorkerRecord(worker_id="d0", role="decode", address="127.0.0.1:2", epoch=2)
    )
    new.register([b"n" * 16])
    old._owned_until = 0.0  # it was stopped for longer than its last check vouches for
    for write in (old.heartbeat, lambda: old.publish(STORED, [b"o" * 16]), lambda: old.register([])):
        with pytest.raises(SupersededError, match=r"epoch 1\) was superseded by epoch 2"):
            write()
    old.deregister()  # not its entries: nothing deleted
    assert read_workers(client)["d0"].address == "127.0.0.1:2"
    assert read_snapshot(client, "d0")[2] == {b"n" * 16} and new.heartbeat()
    # The publisher thread of the old incarnation stops at the first write, and leaves nothing.
    publisher = RegistryPublisher(redis_server.url, old.record, heartbeat_s=0.05)
    publisher.start()
    publisher.offer_snapshot([])
    _wait_until(lambda: publisher.superseded == 2, "the old publisher sees its replacement")
    publisher.stop()
    assert read_workers(client)["d0"].epoch == 2 and new.heartbeat()
    # Its own entries, gone with a Redis restarted empty, are not recreated by an event: the next
    # heartbeat registers again with the whole snapshot (a partial one would pass for it).
    client.flushdb()
    new.publish(STORED, [b"m" * 16])  # (ownership seen just now: it goes out unchecked)
    assert not new.heartbeat()  # the meta has no owner's epoch: register again, whole snapshot
    new.deregister()
    assert "d0" not in read_workers(client)


def test_a_worker_that_dies_unregistered_leaves_nothing_behind(redis_server):
    """SIGKILL, an OOM kill, a lost node: no deregistration. Its snapshot keys expire a while after
    its record (each heartbeat keeps them past readers' grace), and a reader unlists its id once
    record and meta are both gone; an id whose snapshot outlives its record stays listed (a Redis
    that lost the record only, a worker about to beat again)."""
    from registry.schema import (
        WORKERS_SET,
        disk_snapshot_key,
        host_snapshot_key,
        read_workers,
        snapshot_key,
        snapshot_meta_key,
        snapshot_ttl_ms,
    )

    client = connect(redis_server.url)
    reg = WorkerRegistration(
        client, WorkerRecord(worker_id="d-dies", role="decode", address="127.0.0.1:1", epoch=1), ttl_s=5.0
    )
    reg.register([b"a" * 16], [b"b" * 16], [b"c" * 16])
    keys = [
        snapshot_meta_key("d-dies"),
        snapshot_key("d-dies"),
        host_snapshot_key("d-dies"),
        disk_snapshot_key("d-dies"),
    ]
    bound = snapshot_ttl_ms(5000)
    assert bound > 10_000  # past the readers' default grace
    assert all(0 < client.pttl(k) <= bound for k in keys), [client.pttl(k) for k in keys]
    for k in keys:
        client.persist(k)
    assert reg.heartbeat(beat=1)
    assert all(0 < client.pttl(k) <= bound for k in keys)  # each heartbeat keeps them
    # Its record expired, its snapshot not yet: still listed (a reader's grace may yet see it back).
    client.delete(worker_key("d-dies"))
    assert read_workers(client, prune=True) == {} and client.sismember(WORKERS_SET, "d-dies")
    # Both gone: unlisted by the next reader that prunes.
    client.delete(*keys)
    assert read_workers(client) == {} and client.sismember(WORKERS_SET, "d-dies")  # a plain read keeps it
    assert read_workers(client, prune=True) == {} and not client.sismember(WORKERS_SET, "d-dies")
    # The router's view prunes as it polls.
    _register(client, "d-dies-2")
    client.delete(worker_key("d-dies-2"), snapshot_meta_key("d-dies-2"))
    view = ClusterView(redis_server.url, poll_s=0.05, grace_s=LONG_GRACE_S)
    view.start()
    try:
        _wait_until(lambda: not client.sismember(WORKERS_SET, "d-dies-2"), "the view unlists the dead id")
    finally:
        view.stop()
