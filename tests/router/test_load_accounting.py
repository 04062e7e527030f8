"""The router's view of a worker's load (``router.policies.WorkerLoad``): its own requests exactly,
plus what a heartbeat shows beyond those it can show."""

from __future__ import annotations

from engine.block_hash import hash_blocks
from registry.prefix_index import PrefixIndex
from registry.schema import RESYNCED, STORED, KVEventRecord, WorkerRecord
from router.affinity import RoutedPrefixes
from router.policies import DecodeHold, PromptWork, RoutingInput, WorkerLoad, make_policy

BS = 16


def prefill(wid: str, queued: int = 0) -> WorkerRecord:
    return WorkerRecord(
        worker_id=wid, role="prefill", address="-", epoch=1, block_size=BS, queued_prompt_tokens=queued
    )


def decode(wid: str, running: int = 0) -> WorkerRecord:
    return WorkerRecord(
        worker_id=wid,
        role="decode",
        address="-",
        epoch=1,
        block_size=BS,
        num_blocks=8192,
        num_free_blocks=8000,
        num_running=running,
    )


def test_held_requests_count_on_top_of_a_report_never_against_it():
    """Another router runs 20 on d0 and 10 on d1; a burst of ours is held in prefill (no report
    can show it) while d1 reports once more: the burst still evens the two out."""
    policy, inflight = make_policy("least_load"), {}
    reports = {"d0": 20, "d1": 10}
    mine = {"d0": 0, "d1": 0}
    for i in range(30):
        if i == 15:
            reports["d1"] = 11  # one more of the other router's
        ds = [decode(w, n) for w, n in reports.items()]
        route = policy.choose(RoutingInput(iter([]), 64, BS, [prefill("p0")], ds, inflight), PrefixIndex())
        DecodeHold(inflight, route.decode.worker_id)
        mine[route.decode.worker_id] += 1
    total = {w: reports[w] + mine[w] for w in mine}
    assert abs(total["d0"] - total["d1"]) <= 1, (mine, total)
    assert inflight["d1"].busy(11) == total["d1"]


def test_a_fresh_router_spreads_held_requests_over_equally_busy_workers():
    policy, inflight = make_policy("least_load"), {}
    ds = [decode("d0", 1), decode("d1", 1)]  # each runs one of another router's
    got = []
    for _ in range(2):
        route = policy.choose(RoutingInput(iter([]), 64, BS, [prefill("p0")], ds, inflight), PrefixIndex())
        DecodeHold(inflight, route.decode.worker_id)
        got.append(route.decode.worker_id)
    assert sorted(got) == ["d0", "d1"], got


def test_a_late_report_of_our_finished_prefill_keeps_the_next_turn_on_the_warm_worker():
    """Turn 1 prefilled on a worker and finished; its report, taken while it ran, arrives only now.
    Turn 2 of the conversation (its prefix cached there) stays there: that queue was ours."""
    index = PrefixIndex()
    for w in ("p0", "p1"):
        index.apply(KVEventRecord(w, 1, 1, RESYNCED, []))
    policy, inflight, routed = make_policy("cache_aware"), {}, RoutedPrefixes()

    def route(prompt, queued):
        ps = [prefill(w, queued.get(w, 0)) for w in ("p0", "p1")]
        hashes = iter(hash_blocks(prompt, BS))
        return policy.choose(
            RoutingInput(hashes, len(prompt), BS, ps, [decode("d0")], inflight, routed.holders()), index
        )

    turn1 = list(range(1000, 2000))
    warm = route(turn1, {}).prefill.worker_id
    work = PromptWork(inflight, routed, prefill(warm), len(turn1), hash_blocks(turn1, BS), False)
    work.done(True)
    index.apply(KVEventRecord(warm, 1, 2, STORED, hash_blocks(turn1, BS)))
    turn2 = turn1 + list(range(5000, 5200))
    second = route(turn2, {warm: len(turn1)})  # the report taken while turn 1 was queued there
    assert second.prefill.worker_id == warm, (second, inflight[warm])
    assert inflight[warm].queued_tokens(len(turn1)) == 0


def test_another_routers_queue_counts_once_our_report_is_older_than_a_report_can_be(monkeypatch):
    from router import policies

    now = [100.0]
    monkeypatch.setattr(policies.time, "monotonic", lambda: now[0])
    load = WorkerLoad(prompt_tokens=500)
    load.end(500, request=False)
    assert load.queued_tokens(reported=500) == 0  # ours, reported late
    assert load.queued_tokens(reported=800) == 300  # of those, 300 are another router's
    now[0] += policies.REPORT_AGE_S + 0.1
    assert load.queued_tokens(reported=900) == 900  # a later report: all another router's


def test_peers_are_read_only_for_blocks_they_published():
    """A cold burst of a new prefix, peer reads measured as cheap: the first request is only routed
    to p0 (nothing computed there yet, so nothing to lend), and the second is not sent to read it."""
    index = PrefixIndex()
    for w in ("p0", "p1"):
        index.apply(KVEventRecord(w, 1, 1, RESYNCED, []))
    ps = [
        WorkerRecord(worker_id=w, role="prefill", address="-", epoch=1, block_size=BS, peer_hit_cost_pct=20)
        for w in ("p0", "p1")
    ]
    policy, inflight, routed = make_policy("cache_aware"), {}, RoutedPrefixes()
    system = list(range(2000))
    routes = []
    for i in range(2):
        prompt = [*system, *[10_000 + i] * 40]
        inp = RoutingInput(
            iter(hash_blocks(prompt, BS)), len(prompt), BS, ps, [decode("d0")], inflight, routed.holders()
        )
        routes.append(policy.choose(inp, index))
        w = routes[-1].prefill
        PromptWork(
            inflight, routed, w, len(prompt) - routes[-1].predicted_hit_tokens, hash_blocks(prompt, BS), True
        )
    assert routes[1].peer is None, routes[1]
