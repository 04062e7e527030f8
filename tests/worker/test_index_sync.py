"""The router's index converges to the engines' actual prefix caches through a real Redis: after a
mixed workload with evictions, after a worker restart, after dropped events, and after Redis is
killed and restarted empty."""

from __future__ import annotations

import random
import time

import pytest

from engine import EngineConfig, EngineCore, SamplingParams
from registry.cluster_view import ClusterView
from registry.publisher import RegistryPublisher
from registry.registration import WorkerRegistration
from registry.schema import STORED, WorkerRecord, connect, snapshot_key, snapshot_meta_key
from worker.registry_link import RegistryLink


class Worker:
    """An engine plus its registry publisher, driven step by step like the engine loop does."""

    def __init__(self, model_dir, redis_url: str, worker_id: str, epoch: int = 1) -> None:
        self.core = EngineCore(EngineConfig(model=str(model_dir), block_size=4, num_blocks=40))
        self.publisher = RegistryPublisher(
            redis_url,
            WorkerRecord(worker_id=worker_id, role="prefill", address="-", epoch=epoch),
            heartbeat_s=0.2,
        )
        self.publisher.start()
        self.link = RegistryLink(self.core, self.publisher)  # what the engine loop ticks
        self.worker_id = worker_id
        self.n = 0

    def run(self, prompts: list[list[int]]) -> None:
        for p in prompts:
            self.n += 1
            self.core.add_request(
                f"{self.worker_id}-{self.n}", p, SamplingParams(temperature=0, max_tokens=3)
            )
        while self.core.has_unfinished():
            self.core.step()
            self.link.tick()
        self.link.tick()

    def cached(self) -> set[bytes]:
        return set(self.core.kv.pool.cached_hashes())


def _workload(seed: int, n: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 1000) for _ in range(24)]
    return [
        shared[: rng.randrange(0, 24)] + [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 20))]
        for _ in range(n)
    ]


def _converged(view: ClusterView, workers: list[Worker], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = {r.worker_id for r in view.live_workers()}
        if (
            all(view.index.blocks_of(w.worker_id) == w.cached() and w.worker_id in live for w in workers)
            and not view.degraded
        ):
            return
        for w in workers:
            w.link.tick()
        time.sleep(0.05)
    from registry.schema import read_snapshot

    diffs = {
        w.worker_id: (
            len(view.index.blocks_of(w.worker_id)),
            len(w.cached()),
            len(read_snapshot(connect(w.publisher.redis_url), w.worker_id)[2]),
            w.publisher.connected,
            w.publisher.published,
            w.publisher._thread.is_alive(),
        )
        for w in workers
    }
    raise AssertionError(
        f"index did not converge (index, actual, snapshot, connected, published, alive): {diffs}; "
        f"degraded={view.degraded} alive={view._thread.is_alive()} applied={view.events_applied} "
        f"view at {view.last_id} stream tail {connect(workers[0].publisher.redis_url).xrevrange('pdserve:kv_events', count=1)[0][0]} "
        f"len {connect(workers[0].publisher.redis_url).xlen('pdserve:kv_events')} resyncs={view.resyncs} "
        f"clients {[c['addr'] + ':' + c['cmd'] for c in connect(workers[0].publisher.redis_url).client_list()]}"
    )


@pytest.fixture
def view(redis_server):
    v = ClusterView(redis_server.url, poll_s=0.2)
    v.start()
    yield v
    v.stop()


def test_index_equals_cached_blocks_after_mixed_workload(redis_server, view, tiny_llama):
    workers = [Worker(tiny_llama, redis_server.url, f"p{i}") for i in range(2)]
    for round_ in range(3):  # 40 blocks of 4 tokens: later rounds evict earlier blocks
        for i, w in enumerate(workers):
            w.run(_workload(10 * round_ + i))
    assert any(len(w.cached()) > 0 for w in workers)
    _converged(view, workers)
    assert sorted(r.worker_id for r in view.live_workers("prefill")) == ["p0", "p1"]
    for w in workers:
        w.publisher.stop()


def test_restarted_worker_replaces_its_stale_entries(redis_server, view, tiny_llama):
    old = Worker(tiny_llama, redis_server.url, "p0", epoch=1)
    old.run(_workload(1))
    _converged(view, [old])
    stale = view.index.blocks_of("p0")
    assert stale
    old.publisher.stop(deregister=False)  # crashed: no goodbye
    new = Worker(tiny_llama, redis_server.url, "p0", epoch=2)
    new.run(_workload(2))
    _converged(view, [new])
    assert view.index.epoch_of("p0") == 2
    assert not (stale - new.cached()) & view.index.blocks_of("p0")
    new.publisher.stop()


def test_dropped_events_are_detected_and_resynchronised(redis_server, view):
    assert view.wait_synced(10)  # following the stream before the events are written
    client = connect(redis_server.url)
    reg = WorkerRegistration(client, WorkerRecord(worker_id="d0", role="decode", address="-", epoch=3))
    hashes = [bytes([i]) * 16 for i in range(5)]
    reg.register([])
    reg.publish(STORED, hashes[:2])
    # An event lost on its way: the snapshot has it, the stream does not.
    reg.seq += 1
    client.sadd(snapshot_key("d0"), hashes[2])
    client.hset(snapshot_meta_key("d0"), mapping={"epoch": 3, "seq": reg.seq})
    reg.publish(STORED, hashes[3:])
    deadline = time.monotonic() + 5
    while view.index.blocks_of("d0") != set(hashes) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert view.index.blocks_of("d0") == set(hashes)
    assert view.index.gaps_detected >= 1


def test_redis_restart_mid_workload_index_catches_up(redis_server, view, tiny_llama):
    workers = [Worker(tiny_llama, redis_server.url, f"p{i}") for i in range(2)]
    workers[0].run(_workload(5))
    _converged(view, workers)
    redis_server.kill()
    deadline = time.monotonic() + 5
    while not view.degraded and time.monotonic() < deadline:
        time.sleep(0.05)
    assert view.degraded
    known = view.index.blocks_of("p0")
    assert known  # routing keeps its last known index while Redis is down
    for i, w in enumerate(workers):  # requests go on without Redis
        w.run(_workload(20 + i))
    assert all(len(w.cached()) for w in workers)
    redis_server.start()  # empty: the workers re-register from snapshots of their caches
    _converged(view, workers, timeout=15)
    for w in workers:
        w.publisher.stop()


def test_publisher_reconnect_within_an_incarnation_keeps_the_index_exact(redis_server, view, tiny_llama):
    # Regression: a reconnecting publisher restarted its sequence numbers, and readers silently
    # skipped everything after as "already seen".
    workers = [Worker(tiny_llama, redis_server.url, f"p{i}") for i in range(2)]
    workers[0].run(_workload(30))
    _converged(view, workers)
    redis_server.client().client_kill_filter(_type="normal", skipme=True)  # every connection drops
    for i, w in enumerate(workers):
        w.run(_workload(40 + i))
    _converged(view, workers)
    for w in workers:
        w.publisher.stop()


def test_redis_auth_from_the_url(redis_server_factory, tiny_llama):
    server = redis_server_factory(password="s3cret-for-test")
    good = ClusterView(server.url, poll_s=0.2)
    bad = ClusterView(server.url.replace("s3cret-for-test", "wrong"), poll_s=0.2)
    good.start()
    bad.start()
    w = Worker(tiny_llama, server.url, "p0")
    w.run(_workload(3))
    _converged(good, [w])
    assert bad.degraded and bad.index.size == 0  # refused, and says so, without crashing
    w.publisher.stop()
    good.stop()
    bad.stop()
