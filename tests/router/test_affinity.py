"""The router's routed prefixes (what it sent where, before the workers' KV events say so) and the
load it estimates from its own in-flight work plus the heartbeats."""

from __future__ import annotations

from engine.block_hash import hash_blocks, iter_block_hashes
from registry.prefix_index import PrefixIndex
from registry.schema import WorkerRecord
from router.affinity import RoutedPrefixes
from router.policies import RoutingInput, WorkerLoad, make_policy

BS = 4
PROMPT = list(range(100, 132))  # 8 full blocks
HASHES = hash_blocks(PROMPT, BS)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def prefill(wid: str, **load: int) -> WorkerRecord:
    return WorkerRecord(worker_id=wid, role="prefill", address="-", epoch=1, block_size=BS, **load)


DECODE = WorkerRecord(worker_id="d0", role="decode", address="-", epoch=1, block_size=BS, num_free_blocks=99)


def route(prefills, routed=None, inflight=None, prompt=PROMPT):
    inp = RoutingInput(
        iter_block_hashes(prompt, BS), len(prompt), BS, prefills, [DECODE], inflight or {}, routed
    )
    return make_policy("cache_aware").choose(inp, PrefixIndex())


def test_routed_prefix_is_held_while_prefilling_then_for_the_grace_period():
    clock = Clock()
    routed = RoutedPrefixes(grace_s=2.0, max_age_s=60.0, clock=clock)
    token = routed.add("p0", HASHES)
    assert all("p0" in routed.holders()[h] for h in HASHES)
    clock.t = 30.0  # a long prefill: still predicted
    assert HASHES[0] in routed.holders()
    routed.settle(token, computed=True)
    clock.t = 31.9
    assert HASHES[0] in routed.holders()
    clock.t = 32.1  # past the grace: the worker's own KV events are the truth now
    assert routed.holders() == {} and len(routed) == 0


def test_failed_prefill_drops_its_prediction_at_once_and_others_keep_theirs():
    routed = RoutedPrefixes(clock=Clock())
    a = routed.add("p0", HASHES)
    routed.add("p0", HASHES[:2])  # a second request sharing the first two blocks
    routed.settle(a, computed=False)
    holders = routed.holders()
    assert set(holders) == set(HASHES[:2]) and all(holders[h]["p0"] == 1 for h in HASHES[:2])


def test_unsettled_prediction_expires_after_max_age():
    clock = Clock()
    routed = RoutedPrefixes(max_age_s=10.0, clock=clock)
    routed.add("p0", HASHES)
    clock.t = 10.0
    assert routed.holders() == {}


def test_index_match_counts_routed_holders_beside_the_index():
    index = PrefixIndex()
    assert index.match(iter(HASHES), ["p0", "p1"], {h: {"p1"} for h in HASHES[:3]}) == {"p0": 0, "p1": 3}


def test_same_prefix_routed_while_cold_follows_the_first_request():
    """A tenant's requests arriving together: the second sees the first's prefix on p0 (routed, not
    yet in the index) and goes there too, instead of computing the prefix on p1 as well."""
    routed = RoutedPrefixes(clock=Clock())
    ps = [prefill("p0"), prefill("p1")]
    first = route(ps)
    routed.add(first.prefill.worker_id, HASHES)
    inflight = {first.prefill.worker_id: WorkerLoad(prompt_tokens=4, requests=1)}
    second = route(ps, routed.holders(), inflight)
    assert second.prefill.worker_id == first.prefill.worker_id
    # every full block before the prompt's last token: that one is computed (its logits)
    assert second.predicted_hit_tokens == (len(PROMPT) - 1) // BS * BS


def test_a_hot_prefix_spills_to_another_worker_when_its_queue_costs_more_than_recomputing():
    routed = RoutedPrefixes(clock=Clock())
    routed.add("p0", HASHES)
    ps = [prefill("p0"), prefill("p1")]
    inflight = {"p0": WorkerLoad(prompt_tokens=len(PROMPT) + 1, requests=3)}
    assert route(ps, routed.holders(), inflight).prefill.worker_id == "p1"


def test_queued_tokens_are_ours_plus_what_the_heartbeat_shows_beyond_ours():
    load = WorkerLoad(prompt_tokens=500)
    assert load.queued_tokens(reported=500) == 500  # the heartbeat saw only our work
    load.prompt_tokens = 0  # our requests finished; the heartbeat still shows them
    assert load.queued_tokens(reported=500) == 0
    assert load.queued_tokens(reported=800) == 800  # a new heartbeat: another router's 800 tokens
    load.prompt_tokens = 100
    assert load.queued_tokens(reported=800) == 900


def test_a_stale_heartbeat_does_not_push_requests_off_an_idle_warm_worker():
    """p0 holds the prefix and has finished our requests; its last heartbeat still shows them."""
    routed = RoutedPrefixes(clock=Clock())
    routed.add("p0", HASHES)
    ps = [prefill("p0", queued_prompt_tokens=2000), prefill("p1")]
    load = WorkerLoad(prompt_tokens=2000, requests=4)
    inflight = {"p0": load}
    route(ps, routed.holders(), inflight)  # the heartbeat's figure reaches us while ours are queued
    load.prompt_tokens, load.requests = 0, 0
    assert route(ps, routed.holders(), inflight).prefill.worker_id == "p0"


def test_prompt_hashes_are_computed_as_far_as_read_and_finished_on_demand():
    from router.affinity import PromptHashes

    hashes = PromptHashes(PROMPT, BS, "")
    first = next(iter(hashes))
    assert first == HASHES[0] and len(hashes._done) == 1  # the decision read one block: one hashed
    assert list(hashes) == HASHES  # a second read replays and continues the same chain
    assert PromptHashes(PROMPT, BS, "").all() == HASHES
