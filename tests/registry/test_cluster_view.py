"""The registry alone, over a real redis-server: what a worker's publisher writes, the router's cluster
view reads back — its KV events in order, a resync after a gap, a restart, the worker's load, its
departure, and the application draining. No engine: the events are offered by hand."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from registry.cluster_view import ClusterView
from registry.publisher import RegistryPublisher
from registry.registration import WorkerRegistration
from registry.schema import (
    CLEARED,
    DRAINING_KEY,
    REMOVED,
    STORED,
    WorkerRecord,
    connect,
    read_workers,
    set_draining,
    snapshot_key,
    snapshot_meta_key,
    unpack_hashes,
)

H = [bytes([i]) * 16 for i in range(8)]


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting until {what}")
        time.sleep(0.02)


def blocks(view: ClusterView, worker_id: str) -> set[bytes]:
    with view.index.lock:
        return view.index.blocks_of(worker_id)


def record(worker_id: str, epoch: int = 1) -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id, role="prefill", address="127.0.0.1:1", epoch=epoch, num_blocks=64
    )


def converges(view: ClusterView, worker_id: str, expected: set[bytes]) -> None:
    wait_until(
        lambda: blocks(view, worker_id) == expected,
        f"the view holds {len(expected)} blocks for {worker_id} (has {len(blocks(view, worker_id))})",
    )


@pytest.fixture
def views(redis_server) -> Iterator[Callable[[], ClusterView]]:
    """``make()`` -> a started, synced ClusterView; all stopped after the test."""
    started: list[ClusterView] = []

    def make() -> ClusterView:
        view = ClusterView(redis_server.url, poll_s=0.05, grace_s=0.3)
        view.start()
        started.append(view)
        assert view.wait_synced(10), "the cluster view never synced with Redis"
        return view

    yield make
    for view in started:
        view.stop()


@pytest.fixture
def publishers(redis_server) -> Iterator[Callable[..., RegistryPublisher]]:
    """``make(worker_id, epoch=1)`` -> a started publisher that has offered its (empty) first snapshot."""
    started: list[RegistryPublisher] = []

    def make(worker_id: str, epoch: int = 1, cached: list[bytes] | None = None) -> RegistryPublisher:
        pub = RegistryPublisher(redis_server.url, record(worker_id, epoch), heartbeat_s=0.1)
        pub.start()
        started.append(pub)
        assert pub.snapshot_wanted()  # the first registration carries the cache
        pub.offer_snapshot(cached or [])
        return pub

    yield make
    for pub in started:
        pub.stop(deregister=False)


def test_view_follows_stored_removed_and_cleared_events(views, publishers):
    view = views()
    pub = publishers("p0", cached=[H[0], H[1]])
    converges(view, "p0", {H[0], H[1]})
    pub.offer_events([(STORED, [H[2], H[3]]), (REMOVED, [H[0]])])
    converges(view, "p0", {H[1], H[2], H[3]})
    pub.offer_events([(CLEARED, [])])
    converges(view, "p0", set())
    pub.offer_events([(STORED, [H[4], H[5]]), (REMOVED, [H[5]]), (STORED, [H[6]])])
    converges(view, "p0", {H[4], H[6]})
    assert view.index.gaps_detected == 0, "in-order events needed a resync"
    assert not pub.snapshot_wanted()  # nothing failed: no second snapshot asked for
    # A router started now reads the same state from the worker's snapshot.
    converges(views(), "p0", {H[4], H[6]})


def test_events_queued_together_go_out_as_one_transaction_of_their_net_effect(redis_server, views):
    """The publisher takes every batch queued behind the one it woke for and writes their net
    effect: the hashes last removed, then those last stored (their own sequence numbers,
    consecutive); a view and the snapshot agree with the events applied one by one."""
    view = views()
    pub = RegistryPublisher(redis_server.url, record("p0"), heartbeat_s=0.1)
    pub.offer_snapshot([H[0]])
    for batch in (
        [(STORED, [H[1]])],
        [(STORED, [H[2]]), (REMOVED, [H[0]])],
        [(REMOVED, [H[1]])],
        [(STORED, [H[1]])],
    ):
        pub.offer_events(batch)  # queued before the thread runs: it finds them all at once
    pub.start()
    try:
        converges(view, "p0", {H[1], H[2]})
        wait_until(lambda: pub.published == 2, f"2 entries published (have {pub.published})")
        client = connect(redis_server.url)
        entries = [f for _, f in client.xrange("pdserve:kv_events") if f[b"w"] == b"p0"]
        kinds, seqs = [e[b"k"].decode() for e in entries[-2:]], [int(e[b"s"]) for e in entries[-2:]]
        assert kinds == [REMOVED, STORED] and seqs == [seqs[0], seqs[0] + 1]
        assert [set(unpack_hashes(e[b"h"])) for e in entries[-2:]] == [{H[0]}, {H[1], H[2]}]
        assert client.smembers(snapshot_key("p0")) == {H[1], H[2]}
        assert int(client.hget(snapshot_meta_key("p0"), "seq")) == seqs[-1]
        assert view.index.gaps_detected == 0
    finally:
        pub.stop(deregister=False)


def test_events_offered_soon_after_a_transaction_wait_and_go_out_together(redis_server, views, monkeypatch):
    """Transactions of events are ``PUBLISH_INTERVAL_S`` apart: batches offered one by one right
    after one went out (a prefill worker's, a prompt each) leave as one entry."""
    import registry.publisher as publisher

    monkeypatch.setattr(publisher, "PUBLISH_INTERVAL_S", 2.0)  # far longer than two offers take
    view = views()
    pub = RegistryPublisher(redis_server.url, record("p0"), heartbeat_s=0.1)
    pub.offer_snapshot([H[0]])
    pub.start()
    try:
        pub.offer_events([(STORED, [H[1]])])
        wait_until(lambda: pub.published == 1, "the first batch published")
        pub.offer_events([(STORED, [H[2]])])
        wait_until(lambda: pub._queue.empty(), "the publisher took the second batch")  # alone
        pub.offer_events([(STORED, [H[3]])])
        converges(view, "p0", {H[0], H[1], H[2], H[3]})
        wait_until(lambda: pub.published >= 2, "the later batches published")
        client = connect(redis_server.url)
        entries = [f for _, f in client.xrange("pdserve:kv_events") if f[b"w"] == b"p0"]
        assert pub.published == 2, "the two later batches went out as two entries, not one"
        assert entries[-1][b"k"].decode() == STORED
        assert set(unpack_hashes(entries[-1][b"h"])) == {H[2], H[3]}  # one entry holds both
        assert view.index.gaps_detected == 0
    finally:
        pub.stop(deregister=False)


def test_a_gap_in_sequence_numbers_resynchronises_from_the_snapshot(redis_server, views):
    view = views()
    client = connect(redis_server.url)
    reg = WorkerRegistration(client, record("p0"))
    reg.register([H[0]])
    reg.publish(STORED, [H[1]])
    converges(view, "p0", {H[0], H[1]})
    # Event 3 is lost on its way to the stream: the snapshot has it.
    reg.seq += 1
    client.sadd(snapshot_key("p0"), H[2])
    client.hset(snapshot_meta_key("p0"), mapping={"epoch": 1, "seq": reg.seq})
    reg.publish(STORED, [H[3]])  # event 4: the view sees 2 -> 4
    converges(view, "p0", {H[0], H[1], H[2], H[3]})
    assert view.index.gaps_detected == 1
    reg.publish(REMOVED, [H[0]])  # after the resync, events apply one by one again
    converges(view, "p0", {H[1], H[2], H[3]})
    assert view.index.gaps_detected == 1


def test_a_restarted_worker_replaces_its_previous_incarnation(views, publishers):
    view = views()
    old = publishers("p0", epoch=1, cached=[H[0], H[1]])
    converges(view, "p0", {H[0], H[1]})
    old.stop(deregister=False)  # crashed
    publishers("p0", epoch=2, cached=[H[2]])
    converges(view, "p0", {H[2]})
    assert view.index.epoch_of("p0") == 2
    wait_until(lambda: view.workers.get("p0", record("-")).epoch == 2, "the view lists p0's epoch 2")
    later = views()
    converges(later, "p0", {H[2]})
    assert later.index.epoch_of("p0") == 2


def test_heartbeats_carry_the_workers_load_to_the_view(views, publishers):
    view = views()
    pub = publishers("p0")
    pub.offer_load(num_running=3, num_waiting=2, num_free_blocks=7, queued_prompt_tokens=120, step_ms=40)
    want = (3, 2, 7, 120, 40)

    def load() -> tuple[int, ...] | None:
        w = view.workers.get("p0")
        return w and (w.num_running, w.num_waiting, w.num_free_blocks, w.queued_prompt_tokens, w.step_ms)

    wait_until(lambda: load() == want, f"the view has p0's load {want} (has {load()})")


def test_a_deregistered_worker_leaves_the_view(views, publishers):
    view = views()
    leaving = publishers("p0", cached=[H[0], H[1]])
    publishers("p1", cached=[H[1]])
    converges(view, "p0", {H[0], H[1]})
    converges(view, "p1", {H[1]})
    wait_until(lambda: set(view.workers) == {"p0", "p1"}, "the view lists p0 and p1")
    leaving.stop()  # deregisters
    wait_until(lambda: set(view.workers) == {"p1"}, "the view drops p0")
    assert blocks(view, "p0") == set() and view.index.epoch_of("p0") is None
    assert blocks(view, "p1") == {H[1]}
    with view.index.lock:
        assert view.index.match([H[0], H[1]], ["p0", "p1"]) == {"p0": 0, "p1": 0}


def test_set_draining_reaches_the_view(redis_server, views):
    view = views()
    client = connect(redis_server.url)
    assert not view.draining
    set_draining(client, True)
    wait_until(lambda: view.draining, "the view is draining")
    set_draining(client, False)
    wait_until(lambda: not view.draining, "the view takes requests again")
    set_draining(client, True, ttl_s=30)  # expires: a `serve` that crashed mid-drain wedges nothing
    assert 0 < client.pttl(DRAINING_KEY) <= 30_000


def test_a_registry_that_lost_its_data_gets_the_worker_back(redis_server, views, publishers):
    """Redis emptied between two heartbeats, the worker's connection never failing (a restart it
    did not notice, or a flush): its next heartbeat finds its registration gone, and it registers
    again with its whole cache, so routers list it again instead of dropping it after their grace."""
    view = views()
    pub = publishers("p0", cached=[H[0], H[1]])
    converges(view, "p0", {H[0], H[1]})
    client = connect(redis_server.url)
    client.flushall()
    wait_until(pub.snapshot_wanted, "the worker is asked for a snapshot to register again")
    pub.offer_snapshot([H[0], H[1]])
    wait_until(lambda: "p0" in read_workers(client), "Redis lists p0 again")
    assert client.smembers(snapshot_key("p0")) == {H[0], H[1]}
    converges(view, "p0", {H[0], H[1]})
    # The index and the worker list are refreshed by different polls: wait for the list too.
    wait_until(lambda: "p0" in view.workers, "the view lists p0 again")


def test_a_heartbeat_never_lists_a_worker_the_registry_forgot(redis_server):
    """After Redis lost a worker, its heartbeat says so and writes nothing: the worker is listed
    again only by its registration, with its snapshot (readers never see it listed with no cache)."""
    client = connect(redis_server.url)
    reg = WorkerRegistration(client, record("p0"))
    reg.register([H[0], H[1]])
    assert reg.heartbeat(num_running=1) and "p0" in read_workers(client)
    client.flushall()
    assert not reg.heartbeat(num_running=1)
    assert read_workers(client) == {} and not client.smembers(snapshot_key("p0"))
    reg.register([H[0], H[1]])
    assert "p0" in read_workers(client) and client.smembers(snapshot_key("p0")) == {H[0], H[1]}
    assert reg.heartbeat(num_running=2) and read_workers(client)["p0"].num_running == 2


def test_a_worker_falls_silent_when_its_heartbeats_or_its_engines_reports_stop(views, publishers):
    """``silent_for`` (what the router's prefill stall watch reads): small while the worker heartbeats
    and its engine reports its load; rising once the engine stops reporting (a hung engine thread,
    heartbeats still going) and once the heartbeats stop (a stopped process)."""
    view = views()
    hung, stopped = publishers("p0"), publishers("p1")

    def alive(pub: RegistryPublisher) -> bool:
        pub.offer_load(num_running=1)  # what a live engine thread does between its steps
        return view.silent_for(pub.record.worker_id) < 0.3

    for pub in (hung, stopped):
        wait_until(lambda pub=pub: view.workers.get(pub.record.worker_id) is not None, "the view lists it")
        beat = view.workers[pub.record.worker_id].beat
        wait_until(
            lambda pub=pub, b=beat: alive(pub) and view.workers[pub.record.worker_id].beat > b + 2, "beats"
        )
    # p0's engine stops reporting, its heartbeats go on; p1's engine keeps reporting meanwhile
    wait_until(lambda: alive(stopped) and view.silent_for("p0") > 0.5, "p0's engine reports have stopped")
    stopped.stop(deregister=False)  # the process stops: its record stays until its TTL
    wait_until(lambda: view.silent_for("p1") > 0.5, "p1's heartbeats have stopped")
    assert "p1" in view.workers and view.workers["p1"].load_age_ms < 500  # silent by its beats alone


def test_lower_tier_blocks_travel_through_redis_and_a_new_routers_snapshot(views, publishers):
    """A worker's host- and disk-tier blocks (its snapshot's second and third sets, then ``s``/``r``
    and ``d``/``e`` events) reach a running view, and a view started later reads them from the
    snapshot; the device set is apart."""
    from registry.schema import DISK_REMOVED, DISK_STORED, HOST_REMOVED, HOST_STORED

    def tiers(view: ClusterView) -> tuple[int, int, int]:
        with view.index.lock:
            return view.index.match_tiers(H[:6], ["p0"])["p0"]

    view = views()
    pub = publishers("p0")
    pub.offer_snapshot([H[0]], [H[1], H[2]], [H[3]])  # a reconnect's snapshot: every tier
    wait_until(lambda: tiers(view) == (1, 2, 1), "the view holds 1 device, 2 host and 1 disk block")
    assert tiers(views()) == (1, 2, 1)  # a view started now reads every tier's set from Redis
    pub.offer_events([(HOST_STORED, [H[3], H[4]]), (HOST_REMOVED, [H[1]]), (STORED, [H[1]])])
    pub.offer_events([(DISK_STORED, [H[5], H[1]]), (DISK_REMOVED, [H[3]])])
    wait_until(lambda: tiers(view) == (2, 3, 1), "block 1 moved to the device, block 5 is on disk")
    assert view.index.gaps_detected == 0 and view.index.num_disk_blocks_of("p0") == 2
    assert tiers(views()) == (2, 3, 1)  # from the snapshot in Redis


def test_a_reader_joining_at_any_entry_of_net_transactions_ends_where_the_events_one_by_one_end(redis_server):
    """Random histories of transactions (three tiers, clears, empty and repeated batches) published as
    their net effect into a real Redis: a reader starting at each stream entry, resynchronising from
    the snapshot at a gap as ``ClusterView`` does, ends in the state the events one by one leave, and
    so does the snapshot."""
    import random

    from registry.prefix_index import PrefixIndex
    from registry.schema import (
        DISK_REMOVED,
        DISK_STORED,
        EVENTS_STREAM,
        HOST_REMOVED,
        HOST_STORED,
        KVEventRecord,
        read_snapshot,
    )

    tier_of = {STORED: 0, REMOVED: 0, HOST_STORED: 1, HOST_REMOVED: 1, DISK_STORED: 2, DISK_REMOVED: 2}
    stores = {STORED, HOST_STORED, DISK_STORED}
    client = connect(redis_server.url)
    rng = random.Random(11)
    for trial in range(40):
        worker = f"w{trial}"
        reg = WorkerRegistration(client, record(worker))
        state = [set(rng.sample(H, 3)), set(rng.sample(H, 2)), set(rng.sample(H, 2))]
        reg.register(*[list(s) for s in state])
        for _ in range(rng.randint(1, 6)):
            batches = []
            for _ in range(rng.randint(0, 10)):
                r = rng.random()
                if r < 0.07:
                    batches.append((CLEARED, []))
                else:
                    n = 0 if r < 0.12 else rng.randint(1, 4)
                    batches.append((rng.choice(list(tier_of)), [rng.choice(H) for _ in range(n)]))
            reg.publish_many(batches)
            for kind, hashes in batches:  # the truth: each event in turn
                if kind == CLEARED:
                    state = [set(), set(), set()]
                elif kind in stores:
                    state[tier_of[kind]].update(hashes)
                else:
                    state[tier_of[kind]].difference_update(hashes)
        entries = [
            KVEventRecord.from_fields(f)
            for _, f in client.xrange(EVENTS_STREAM)
            if f[b"w"] == worker.encode()
        ]
        for start in range(len(entries)):
            index = PrefixIndex()
            for ev in entries[start:]:
                if not index.apply(ev):
                    index.replace(worker, *read_snapshot(client, worker))
            held = [
                index.blocks_of(worker),
                index._host.blocks.get(worker, set()),
                index._disk.blocks.get(worker, set()),
            ]
            assert held == state, (trial, start)
        assert list(read_snapshot(client, worker)[2:]) == state, trial
