"""Routing policies on hand-built worker records and an index fed with KV events: which (P, D) pair
each policy picks, and the prefix hit it predicts. Hashes are the engines' (``engine.block_hash``),
handed to the policy lazily as the router does."""

from __future__ import annotations

import pytest

from engine.block_hash import hash_blocks, iter_block_hashes
from registry.prefix_index import PrefixIndex
from registry.schema import RESYNCED, KVEventRecord, WorkerRecord
from router.policies import POLICIES, RoutingInput, WorkerLoad, make_policy
from router.router import Router

BS = 4
PROMPT = list(range(100, 132))  # 32 tokens: 8 full blocks
HASHES = hash_blocks(PROMPT, BS)


def prefill(wid: str, **load: int) -> WorkerRecord:
    return WorkerRecord(worker_id=wid, role="prefill", address="-", epoch=1, block_size=BS, **load)


def decode(wid: str, free: int = 100, **load: int) -> WorkerRecord:
    return WorkerRecord(
        worker_id=wid, role="decode", address="-", epoch=1, block_size=BS, num_free_blocks=free, **load
    )


def index_of(cached: dict[str, list[bytes]]) -> PrefixIndex:
    """An index fed the way the cluster view feeds it: one RESYNCED event per worker."""
    idx = PrefixIndex()
    for wid, hashes in cached.items():
        assert idx.apply(KVEventRecord(wid, 1, 1, RESYNCED, hashes))
    return idx


def unrelated(n: int, seed: int) -> list[bytes]:
    return hash_blocks([seed * 1000 + i for i in range(n * BS)], BS)


def inp(prefills, decodes, prompt=PROMPT, inflight=None) -> RoutingInput:
    return RoutingInput(
        iter_block_hashes(prompt, BS), len(prompt), BS, list(prefills), list(decodes), inflight or {}
    )


def choose(policy: str, prefills, decodes, index=None, **kw):
    return make_policy(policy).choose(inp(prefills, decodes, **kw), index or PrefixIndex())


# round_robin / least_load ---------------------------------------------------------------------


def test_round_robin_alternates_prefill_and_decode_workers():
    policy = make_policy("round_robin")
    ps, ds = [prefill("p0"), prefill("p1")], [decode("d0"), decode("d1"), decode("d2")]
    routes = [policy.choose(inp(ps, ds), PrefixIndex()) for _ in range(4)]
    assert [r.prefill.worker_id for r in routes] == ["p0", "p1", "p0", "p1"]
    assert [r.decode.worker_id for r in routes] == ["d0", "d1", "d2", "d0"]


def test_least_load_prefill_goes_to_the_fewest_queued_tokens():
    ps = [prefill("p0", queued_prompt_tokens=100), prefill("p1", queued_prompt_tokens=10)]
    assert choose("least_load", ps, [decode("d0")]).prefill.worker_id == "p1"
    # The router's own in-flight count is exact where the heartbeat lags: it raises p1's queue.
    busy_p1 = {"p1": WorkerLoad(prompt_tokens=500, requests=3)}
    assert choose("least_load", ps, [decode("d0")], inflight=busy_p1).prefill.worker_id == "p0"


def test_least_load_decode_goes_to_the_least_busy_then_the_most_free_blocks():
    p = [prefill("p0")]
    assert choose("least_load", p, [decode("d0", num_running=2), decode("d1")]).decode.worker_id == "d1"
    assert choose("least_load", p, [decode("d0", free=50), decode("d1", free=10)]).decode.worker_id == "d0"
    # Busy beats free blocks: waiting requests count as busy, and so do the router's own.
    ds = [decode("d0", free=90, num_waiting=1), decode("d1", free=10)]
    assert choose("least_load", p, ds).decode.worker_id == "d1"
    ds = [decode("d0", free=90), decode("d1", free=10)]
    inflight = {"d0": WorkerLoad(requests=2)}
    assert choose("least_load", p, ds, inflight=inflight).decode.worker_id == "d1"


# cache_aware: prefill -------------------------------------------------------------------------


def test_cache_aware_prefers_the_longest_cached_prefix():
    index = index_of({"p0": HASHES[:2], "p1": HASHES[:6], "p2": HASHES[:1] + HASHES[2:8]})
    route = choose("cache_aware", [prefill("p0"), prefill("p1"), prefill("p2")], [decode("d0")], index)
    assert route.prefill.worker_id == "p1"  # p2 holds more blocks, but its prefix stops at block 1
    assert route.predicted_hit_tokens == 6 * BS


def test_cache_aware_leaves_a_warm_worker_whose_queue_costs_more_than_recomputing():
    index = index_of({"p0": HASHES[:6], "p1": HASHES[:2]})
    ps = lambda q: [prefill("p0", queued_prompt_tokens=q), prefill("p1")]  # noqa: E731
    # Cost = uncached prompt tokens + tokens queued: p0 = 32 - 24 + q, p1 = 32 - 8 = 24.
    route = choose("cache_aware", ps(15), [decode("d0")], index)
    assert (route.prefill.worker_id, route.predicted_hit_tokens) == ("p0", 24)
    route = choose("cache_aware", ps(17), [decode("d0")], index)
    assert (route.prefill.worker_id, route.predicted_hit_tokens) == ("p1", 8)
    # The same through the router's own in-flight count, the heartbeat still saying idle.
    inflight = {"p0": WorkerLoad(prompt_tokens=17, requests=1)}
    assert choose("cache_aware", ps(0), [decode("d0")], index, inflight=inflight).prefill.worker_id == "p1"


def test_cache_aware_equal_cost_goes_to_the_longer_hit():
    index = index_of({"p0": HASHES[:2], "p1": HASHES[:6]})
    ps = [prefill("p0"), prefill("p1", queued_prompt_tokens=16)]  # both cost 24 tokens
    assert choose("cache_aware", ps, [decode("d0")], index).prefill.worker_id == "p1"


@pytest.mark.parametrize("fuller", ["p0", "p1"])
def test_cache_aware_new_prefix_on_idle_workers_goes_where_the_cache_has_most_room(fuller):
    emptier = "p1" if fuller == "p0" else "p0"
    index = index_of({fuller: unrelated(10, 1), emptier: unrelated(3, 2)})
    route = choose("cache_aware", [prefill("p0"), prefill("p1")], [decode("d0")], index)
    assert (route.prefill.worker_id, route.predicted_hit_tokens) == (emptier, 0)


# cache_aware: decode --------------------------------------------------------------------------


def test_cache_aware_decode_by_busy_and_free_blocks_its_own_prefix_breaking_ties():
    p = [prefill("p0")]
    index = index_of({"d1": HASHES[:4]})
    assert choose("cache_aware", p, [decode("d0"), decode("d1")], index).decode.worker_id == "d1"
    # Its prefix only breaks ties: more free blocks win over it, and so does a less busy worker.
    ds = [decode("d0", free=101), decode("d1")]
    assert choose("cache_aware", p, ds, index).decode.worker_id == "d0"
    ds = [decode("d0"), decode("d1", num_running=1)]
    assert choose("cache_aware", p, ds, index).decode.worker_id == "d0"
    # Between two holders the longer prefix wins.
    index = index_of({"d0": HASHES[:2], "d1": HASHES[:5]})
    assert choose("cache_aware", p, [decode("d0"), decode("d1")], index).decode.worker_id == "d1"


def test_a_decode_worker_holding_the_prefix_keeps_it_over_small_free_block_differences():
    """A heartbeat taken while the conversation's last turn ran shows its blocks in use: a
    difference under a sixteenth of the cache does not outrank the prefix; a larger one does."""
    p = [prefill("p0")]
    index = index_of({"d1": HASHES[:4]})
    ds = [decode("d0", free=4096, num_blocks=4096), decode("d1", free=4082, num_blocks=4096)]
    assert choose("cache_aware", p, ds, index).decode.worker_id == "d1"
    ds = [decode("d0", free=4096, num_blocks=4096), decode("d1", free=3000, num_blocks=4096)]
    assert choose("cache_aware", p, ds, index).decode.worker_id == "d0"


def test_our_request_that_just_ended_is_not_taken_for_another_routers_from_a_stale_heartbeat(monkeypatch):
    """The router's request on d1 ended; d1's heartbeat, taken while it ran, still shows it running.
    The next request of that prefix stays on d1, while another router's request (beyond ours)
    counts, and the report of ours is believed again once it is older than a report can be."""
    from router import policies

    now = [100.0]
    monkeypatch.setattr(policies.time, "monotonic", lambda: now[0])
    p = [prefill("p0")]
    index = index_of({"d1": HASHES[:4]})
    load = WorkerLoad(requests=1)
    load.end()
    inflight = {"d1": load}
    stale = [decode("d0"), decode("d1", num_running=1)]
    assert choose("cache_aware", p, stale, index, inflight=inflight).decode.worker_id == "d1"
    busier = [decode("d0"), decode("d1", num_running=2)]  # one of another router's runs there
    assert choose("cache_aware", p, busier, index, inflight=inflight).decode.worker_id == "d0"
    now[0] += policies.REPORT_AGE_S + 0.1
    later = [decode("d0"), decode("d1", num_running=1)]  # a later report: that one runs
    fresh = {"d1": WorkerLoad()}
    fresh["d1"]._ended = load._ended
    assert choose("cache_aware", p, later, index, inflight=fresh).decode.worker_id == "d0"


def test_under_a_steady_load_another_routers_requests_count_in_full(monkeypatch):
    """Two routers (front ends) share d0: ours run 4 there steadily, ending and replaced, the other
    router's 4 more. d1 runs ours 4 only. The report's 8 on d0 is 4 of ours at most, so d0 is the
    busier one, however many of ours ended there lately."""
    from router import policies

    now = [100.0]
    monkeypatch.setattr(policies.time, "monotonic", lambda: now[0])
    loads = {"d0": WorkerLoad(requests=4), "d1": WorkerLoad(requests=4)}
    for _ in range(50):  # 50 of ours ended and were replaced on each within the last second
        now[0] += 0.02
        for load in loads.values():
            load.end()
            load.requests += 1
    ds = [decode("d0", num_running=8), decode("d1", num_running=4)]
    assert choose("least_load", [prefill("p0")], ds, inflight=loads).decode.worker_id == "d1"
    assert loads["d0"].busy(8) == 8 and loads["d1"].busy(4) == 4


# predicted hits, aggregated mode, names -------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_predicted_hit_tokens_count_whole_blocks_of_the_chosen_prefill(policy):
    prompt = PROMPT[:30]  # 7 full blocks and 2 tokens: the partial block is never cached
    index = index_of({"p0": hash_blocks(prompt, BS)})
    route = choose(policy, [prefill("p0")], [decode("d0")], index, prompt=prompt)
    assert (route.prefill.worker_id, route.predicted_hit_tokens) == ("p0", 28)
    index = index_of({"p0": HASHES[:3] + HASHES[4:]})  # a hole at block 3 ends the prefix
    assert choose(policy, [prefill("p0")], [decode("d0")], index).predicted_hit_tokens == 12


@pytest.mark.parametrize("policy", POLICIES)
def test_no_prefill_workers_routes_aggregated_to_a_decode_worker(policy):
    index = index_of({"d1": HASHES})
    route = choose(policy, [], [decode("d1"), decode("d0", num_running=1)], index)
    hit = 28 if policy == "cache_aware" else 0  # d1 computes the prompt: its 7 usable blocks are hits
    assert route.prefill is None and route.decode.worker_id == "d1" and route.predicted_hit_tokens == hit


def test_aggregated_a_prompt_goes_where_its_prefix_is_until_that_queue_costs_more():
    """No prefill workers: the decode worker computes the prompt, so cache_aware weighs it as it
    does a prefill worker. d0 holds the prompt's 7 usable blocks (28 tokens) and runs more requests
    than d1: it wins while its queue is under the 28 tokens it saves; past that d1 computes it. A
    host-tier hit counts at its measured cost. least_load goes by running requests alone."""
    idx = index_of({"d0": HASHES[:8], "d1": []})

    def route(policy: str = "cache_aware", queued: int = 0, index=idx, **d0):
        ds = [decode("d0", num_running=3, queued_prompt_tokens=queued, **d0), decode("d1")]
        return choose(policy, [], ds, index)

    assert (route().decode.worker_id, route().predicted_hit_tokens) == ("d0", 28)
    assert route(queued=27).decode.worker_id == "d0"
    assert route(queued=29).decode.worker_id == "d1"
    assert route("least_load").decode.worker_id == "d1"
    host = index_of({"d1": []})
    assert host.apply(KVEventRecord("d0", 1, 1, RESYNCED, [], HASHES[:8]))
    assert route(queued=10, index=host, host_hit_cost_pct=50).decode.worker_id == "d0"  # saves 14
    assert route(queued=15, index=host, host_hit_cost_pct=50).decode.worker_id == "d1"


def test_make_policy_rejects_an_unknown_name():
    with pytest.raises(ValueError, match="routing policy must be one of"):
        make_policy("random")
    assert [make_policy(name).name for name in POLICIES] == list(POLICIES)


class _View:
    """What the router reads of a ClusterView: its live workers and its index."""

    def __init__(self, workers: list[WorkerRecord], index: PrefixIndex) -> None:
        self.workers, self.index = workers, index

    def live_workers(self, role: str | None = None) -> list[WorkerRecord]:
        return [w for w in self.workers if role is None or w.role == role]


def test_a_sole_aggregated_worker_is_routed_to_without_weighing_anything():
    """One decode worker and no prefill workers: nothing to choose, so the router neither looks the
    prompt up nor hashes it (its per-request cost on the short-request path); with two it weighs."""

    class Counting(PrefixIndex):
        lookups = 0

        def match_tiers(self, *args, **kwargs):
            Counting.lookups += 1
            return super().match_tiers(*args, **kwargs)

    index = Counting()
    one, two = [decode("d0")], [decode("d0"), decode("d1")]
    route, hashes = Router(_View(one, index))._route(PROMPT)
    assert (route.decode.worker_id, route.sole, Counting.lookups, hashes._done) == ("d0", True, 0, [])
    route = Router(_View(two, index)).route(PROMPT)
    assert not route.sole and Counting.lookups == 1


def test_router_hashes_the_prompt_with_the_workers_block_size_and_salt():
    """The router's keys equal the engines': same block size, same cache salt (the model's namespace)."""
    bs, salt = 8, "tiny-llama"
    workers = [
        WorkerRecord("p0", "prefill", "-", 1, block_size=bs, cache_salt=salt),
        WorkerRecord("p1", "prefill", "-", 1, block_size=bs, cache_salt=salt),
        WorkerRecord("d0", "decode", "-", 1, block_size=bs, cache_salt=salt, num_free_blocks=10),
    ]
    # p1's blocks are the prompt's unsalted keys: a router hashing without the salt would pick it.
    index = index_of({"p0": hash_blocks(PROMPT[:24], bs, salt), "p1": hash_blocks(PROMPT, bs)})
    route = Router(_View(workers, index)).route(PROMPT)
    assert (route.prefill.worker_id, route.predicted_hit_tokens) == ("p0", 24)


# cache tiers -------------------------------------------------------------------------------------


def test_a_host_tier_hit_counts_between_a_device_hit_and_a_miss_by_its_measured_cost():
    """p0 holds the prompt's 8 blocks in its host tier, p1 nothing; p1 has 20 tokens less queued.
    A cheap load (10% of computing a block) makes p0 the faster place for the first token; a load
    that measured as dear as computing (100%) is worth no more than a miss, and the queue decides."""
    idx = index_of({"p1": []})
    assert idx.apply(KVEventRecord("p0", 1, 1, RESYNCED, [], HASHES[:8]))
    for cost, expected in ((10, "p0"), (100, "p1")):
        ps = [prefill("p0", queued_prompt_tokens=20, host_hit_cost_pct=cost), prefill("p1")]
        route = choose("cache_aware", ps, [decode("d0")], idx)
        assert route.prefill.worker_id == expected, cost
    # Against a device hit of the same blocks, a host hit loses however cheap its load.
    dev = index_of({"p1": HASHES[:8]})
    assert dev.apply(KVEventRecord("p0", 1, 1, RESYNCED, [], HASHES[:8]))
    ps = [prefill("p0", host_hit_cost_pct=1), prefill("p1")]
    assert choose("cache_aware", ps, [decode("d0")], dev).prefill.worker_id == "p1"


def test_a_disk_tier_hit_counts_between_a_host_hit_and_a_miss_by_its_own_measured_cost():
    """The prompt's 8 blocks in one worker's host tier, in another's disk tier, nowhere on a third.
    Loads measured at 10% (host) and 40% (disk) of computing a block: on equal queues the host hit
    wins, then the disk hit, then the miss; a disk hit's worth is its own measurement, not the host's."""
    idx = index_of({"miss": []})
    assert idx.apply(KVEventRecord("host", 1, 1, RESYNCED, [], HASHES[:8]))
    assert idx.apply(KVEventRecord("disk", 1, 1, RESYNCED, [], [], HASHES[:8]))
    costs = dict(host_hit_cost_pct=10, disk_hit_cost_pct=40)

    def pick(*workers, **load) -> str:
        ps = [prefill(w, **{**costs, **load.get(w, {})}) for w in workers]
        return choose("cache_aware", ps, [decode("d0")], idx).prefill.worker_id

    assert pick("miss", "disk", "host") == "host"
    assert pick("miss", "disk") == "disk"
    # 7 blocks of 4 tokens hit (the last token is computed): a disk hit saves 60% of 28 = 16.8 tokens
    assert pick("miss", "disk", disk=dict(queued_prompt_tokens=16)) == "disk"
    assert pick("miss", "disk", disk=dict(queued_prompt_tokens=17)) == "miss"
    # A host hit saves more than a disk hit: 90% of 28 = 25.2 tokens.
    assert pick("disk", "host", host=dict(queued_prompt_tokens=8)) == "host"
    assert pick("disk", "host", host=dict(queued_prompt_tokens=9)) == "disk"
    # A disk read measured as dear as computing is worth a miss, however cheap the worker's host tier.
    dear = dict(host_hit_cost_pct=0, disk_hit_cost_pct=100, queued_prompt_tokens=1)
    assert pick("miss", "disk", disk=dear) == "miss"
    ps = [prefill("disk", **costs), prefill("miss")]
    assert choose("cache_aware", ps, [decode("d0")], idx).predicted_hit_tokens == 7 * BS


def test_a_busy_owners_prefix_is_read_by_an_idle_worker_that_reads_peers():
    """p0 holds the prompt's 8 blocks (7 usable: the last token is computed) on its device and has
    40 tokens queued; p1 holds nothing. p1 reading them at 20% of computing saves 80% of 28 = 22.4
    tokens: it wins with the read against p0's queue, and the route names p0 as the peer. A worker
    that reads no peers (100%: no host tier) computes; a queue shorter than the saving keeps p0."""
    idx = index_of({"p0": HASHES[:8], "p1": []})

    def route(p0_queue: int, p1_cost: int):
        ps = [prefill("p0", queued_prompt_tokens=p0_queue), prefill("p1", peer_hit_cost_pct=p1_cost)]
        return choose("cache_aware", ps, [decode("d0")], idx)

    r = route(40, 20)
    assert (r.prefill.worker_id, r.peer.worker_id, r.peer_blocks, r.predicted_hit_tokens) == (
        "p1",
        "p0",
        7,
        28,
    )
    r = route(40, 100)
    assert (r.prefill.worker_id, r.peer) == ("p1", None)  # p1 computes all 32: still sooner than 40 queued
    assert route(5, 20).prefill.worker_id == "p0"  # 5 queued beats reading: p0 serves its own hit
    assert route(5, 20).peer is None
    # Where the owner's blocks are in its host tier, they are lent the same way.
    host = index_of({"p1": []})
    assert host.apply(KVEventRecord("p0", 1, 1, RESYNCED, HASHES[:2], HASHES[2:8]))
    ps = [prefill("p0", queued_prompt_tokens=40), prefill("p1", peer_hit_cost_pct=20)]
    r = choose("cache_aware", ps, [decode("d0")], host)
    assert (r.prefill.worker_id, r.peer.worker_id, r.peer_blocks) == ("p1", "p0", 7)


def test_a_reader_reads_only_the_blocks_past_its_own_hits():
    """p1 holds the first 4 blocks itself: a read is worth its 3 missing blocks, and the peer with the
    longest run is the one named."""
    idx = index_of({"p0": HASHES[:8], "p1": HASHES[:4], "p2": HASHES[:6]})
    ps = [
        prefill("p0", queued_prompt_tokens=100),
        prefill("p1", peer_hit_cost_pct=0),
        prefill("p2", queued_prompt_tokens=100),
    ]
    r = choose("cache_aware", ps, [decode("d0")], idx)
    assert (r.prefill.worker_id, r.peer.worker_id, r.peer_blocks) == ("p1", "p0", 7)


def test_peer_reads_can_be_turned_off():
    """``--no-peer-reads``: the busy owner's tenant is computed by the idle worker, not read."""
    idx = index_of({"p0": HASHES[:8], "p1": []})
    ps = [prefill("p0", queued_prompt_tokens=40), prefill("p1", peer_hit_cost_pct=20)]
    policy = make_policy("cache_aware")
    policy.peer_reads = False
    r = policy.choose(inp(ps, [decode("d0")]), idx)
    assert (r.prefill.worker_id, r.peer, r.predicted_hit_tokens) == ("p1", None, 0)


def test_aggregated_the_decode_worker_chosen_by_load_reads_the_prefix_from_the_one_holding_it():
    """No prefill workers: d0 holds the prompt's 8 blocks (3 on its device, 5 in a host tier whose
    loads measured as dear as computing) and runs 3 requests; d1 holds none but reads a peer's
    blocks at 20% of computing them. Reading the 7 usable blocks saves d1 more than its own hits
    save d0, so d1 computes the prompt with d0 as the peer; a worker that reads no peers (100%), one
    whose own hits are as long, or peer reads turned off compute instead."""
    idx = index_of({"d1": []})
    assert idx.apply(KVEventRecord("d0", 1, 1, RESYNCED, HASHES[:3], HASHES[3:8]))

    def route(d1_cost: int, reads: bool = True, index=idx):
        ds = [decode("d0", num_running=3), decode("d1", peer_hit_cost_pct=d1_cost)]
        policy = make_policy("cache_aware")
        policy.peer_reads = reads
        return policy.choose(inp([], ds), index)

    r = route(20)
    assert (r.prefill, r.decode.worker_id, r.peer.worker_id, r.peer_blocks, r.predicted_hit_tokens) == (
        None,
        "d1",
        "d0",
        7,
        28,
    )
    assert route(100).peer is None
    assert route(20, reads=False).peer is None
    own = index_of({"d0": HASHES[:8], "d1": HASHES[:8]})
    assert route(0, index=own).peer is None  # d1's own device hits: nothing to read


def test_adapters_decide_candidates_salt_and_hand_off():
    from router.policies import Route, salt_of, serves, with_handoff

    loras = '{"sql": "|lora=v1"}'
    p = WorkerRecord("p0", "prefill", "-", 1, cache_salt="s", loras=loras)
    d_same = WorkerRecord("d0", "decode", "-", 1, cache_salt="s", loras=loras)
    d_other = WorkerRecord("d1", "decode", "-", 1, cache_salt="s", loras='{"sql": "|lora=v2"}')
    d_none = WorkerRecord("d2", "decode", "-", 1, cache_salt="s")
    assert serves(d_same, "sql") and not serves(d_none, "sql") and serves(d_none, "")
    # The adapter's prompts hash in its namespace, as its engine hashes them; the base's do not.
    assert salt_of(p, "sql") == "s|lora=v1" and salt_of(p, "") == "s"
    assert d_same.adapters() == ["sql"] and d_none.adapters() == []
    # The KV moves between workers with the same weights of the adapter; to one with another version
    # of it the request runs aggregated there (its own weights compute the prompt).
    assert with_handoff(Route(p, d_same), "sql").prefill is p
    assert with_handoff(Route(p, d_other), "sql").prefill is None
    assert with_handoff(Route(p, d_other), "").prefill is p  # the base model is the same everywhere


@pytest.mark.parametrize("policy", ["least_load", "cache_aware"])
def test_among_equal_workers_a_request_goes_where_its_adapter_is_resident(policy):
    loras = '{"sql": "|lora=v1", "poet": "|lora=v2"}'
    resident = {"d0": '["poet"]', "d1": '["sql"]', "p0": '["poet"]', "p1": '["sql"]'}
    decodes = [decode(w, loras=loras, resident_loras=resident[w]) for w in ("d0", "d1")]
    prefills = [prefill(w, loras=loras, resident_loras=resident[w]) for w in ("p0", "p1")]
    pick = make_policy(policy)

    def route(lora: str):
        inp = RoutingInput(iter(HASHES), len(PROMPT), BS, prefills, decodes, lora=lora)
        return pick.choose(inp, index_of({}))

    r = route("sql")
    assert (r.prefill.worker_id, r.decode.worker_id) == ("p1", "d1")
    r = route("poet")
    assert (r.prefill.worker_id, r.decode.worker_id) == ("p0", "d0")
    r = route("")  # the base model: the usual ties
    assert (r.prefill.worker_id, r.decode.worker_id) == ("p0", "d0")
    # Load comes first: a busier worker is not chosen for its resident adapter.
    decodes[1] = decode("d1", loras=loras, resident_loras='["sql"]', num_running=3)
    assert route("sql").decode.worker_id == "d0"
