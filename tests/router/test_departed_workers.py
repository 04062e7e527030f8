"""A worker that left the cluster is never routed to, whichever the policy: one that deregistered (a
drain, a scale-down) and one whose record expired (it crashed and stopped heartbeating). The router
reads a real ClusterView following a real Redis."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import pytest
import redis

from engine.block_hash import hash_blocks
from registry.cluster_view import ClusterView
from registry.registration import WorkerRegistration
from registry.schema import WorkerRecord, connect, worker_key
from router.policies import POLICIES
from router.router import Router
from router.service import _indexed

BS = 4
PROMPT = list(range(7, 7 + 8 * BS))
N = 40


@pytest.fixture
def view(redis_server):
    v = ClusterView(redis_server.url, poll_s=0.05, grace_s=0.3)
    v.start()
    yield v
    v.stop()


def register(
    client: redis.Redis, wid: str, role: str, free: int, cached: list[bytes], queued: int = 0
) -> WorkerRegistration:
    record = WorkerRecord(
        worker_id=wid,
        role=role,
        address="127.0.0.1:1",  # never called: these tests stop at the routing decision
        epoch=1,
        block_size=BS,
        num_blocks=100,
        num_free_blocks=free,
        queued_prompt_tokens=queued,
    )
    reg = WorkerRegistration(client, record, ttl_s=120)
    reg.register(cached)
    return reg


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting until {what}")
        time.sleep(0.02)


def routed(view: ClusterView, policy: str) -> Counter[str]:
    """Where ``N`` requests for the prompt go (prefill and decode workers together)."""
    router = Router(view, policy)
    counts: Counter[str] = Counter()
    for _ in range(N):
        route = router.route(PROMPT)
        counts[route.prefill.worker_id] += 1
        counts[route.decode.worker_id] += 1
    return counts


def live_ids(view: ClusterView) -> set[str]:
    return {w.worker_id for w in view.live_workers()}


@pytest.mark.parametrize("how", ["deregistered", "expired"])
def test_a_worker_that_left_is_never_routed_to(redis_server, view, how):
    client = connect(redis_server.url)
    cached = hash_blocks(PROMPT, BS)
    # p1 and d1 are every policy's favourites: the whole prompt cached, idle, the most free blocks.
    register(client, "p0", "prefill", 50, [], queued=10)
    register(client, "d0", "decode", 50, [])
    leaving = [register(client, "p1", "prefill", 90, cached), register(client, "d1", "decode", 90, cached)]
    wait_until(
        lambda: live_ids(view) == {"p0", "p1", "d0", "d1"} and view.index.blocks_of("p1") == set(cached),
        "the view lists all four workers and p1's cache",
    )
    indexed = {w.worker_id: w.blocks for w in _indexed(view.index)}  # GetClusterState's ``indexed``
    assert indexed["p1"] == indexed["d1"] == len(cached), indexed
    for policy in POLICIES:  # while they are here, they get traffic
        counts = routed(view, policy)
        assert counts["p1"] > 0 and counts["d1"] > 0, (policy, counts)

    for reg in leaving:
        if how == "deregistered":
            reg.deregister()
        else:  # its heartbeats stopped: the record expires
            client.pexpire(worker_key(reg.record.worker_id), 1)
    wait_until(lambda: live_ids(view) == {"p0", "d0"}, "the view drops p1 and d1")

    for policy in POLICIES:
        assert routed(view, policy) == {"p0": N, "d0": N}, policy
    assert view.index.blocks_of("p1") == set() and view.index.blocks_of("d1") == set()
    assert {w.worker_id for w in _indexed(view.index)} == {"p0", "d0"}
