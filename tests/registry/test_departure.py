"""A worker that deregisters (a drain, a scale-down) leaves the router's view at once, while one whose
record merely vanished (a Redis restarted empty, a missed heartbeat) is kept for the grace period."""

from __future__ import annotations

import time

from registry.cluster_view import ClusterView
from registry.schema import WorkerRecord, WorkerRegistration, connect, worker_key

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
