"""The deployment simulator against what its cost model says by hand: one request's timeline, FIFO
chunked prefill, the real cache-aware policy sending a tenant back to its prefix, the local-prefill
rule, aggregated mode, a decode pool that runs out of blocks, a prefix cache read when a prompt is
scheduled, and the summary's percentiles."""

from __future__ import annotations

import pytest
from synthetic import BS, PREFILL, synthetic_profile

from planner.simulator import Deployment, SimRequest, Simulator, hop_medians, summarize


def prompt(tenant: int, length: int, salt: int = 0) -> list[int]:
    return [(tenant * 1000 + salt * 7 + i) % 30000 + 10 for i in range(length)]


def test_one_request_follows_the_cost_curves_step_by_step():
    p = synthetic_profile()
    [r] = Simulator(p, Deployment(1, 1)).run([SimRequest(1.0, prompt(1, 200), 4)])
    ttft = p.prefill_s(200, 0)
    assert r.first_token == pytest.approx(1.0 + ttft, rel=0, abs=1e-12)
    # The KV moves (13 whole blocks), then each decode step makes one token at the growing context
    # (the prompt and the tokens so far, the prefill's first one included).
    t = r.first_token + p.transfer_s(200)
    expected = [r.first_token]
    for k in range(3):
        t += p.decode_step_s(1, 201 + k)
        expected.append(t)
    assert r.token_times == pytest.approx(expected, rel=0, abs=1e-12)


def test_prompts_wait_their_turn_in_token_budget_chunks():
    p = synthetic_profile(budget=256)
    a, b = Simulator(p, Deployment(1, 1)).run(
        [SimRequest(0.0, prompt(1, 300), 1), SimRequest(0.0, prompt(2, 400), 1)]
    )
    base, tok, ctx = PREFILL
    first = base + tok * 256 + ctx * 256 * 128  # a's first 256 tokens: the whole budget
    second = base + tok * 256 + ctx * (44 * (256 + 22) + 212 * 106)  # a's last 44, then b's first 212
    third = base + tok * 188 + ctx * 188 * (212 + 94)  # b's last 188
    assert a.first_token == pytest.approx(first + second)
    assert b.first_token == pytest.approx(first + second + third)


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
def test_the_real_policy_decides_where_a_tenant_finds_its_prefix(policy):
    p = synthetic_profile()
    tenants = [0, 0, 1, 1, 0, 0, 1, 1]
    requests = [
        SimRequest(float(i), prompt(t, 512) + prompt(9, 32, salt=i), 2) for i, t in enumerate(tenants)
    ]
    Simulator(p, Deployment(2, 1, policy=policy)).run(requests)
    again = [r.cached_tokens for i, r in enumerate(requests) if tenants[i] in tenants[:i]]  # prefix seen
    if policy == "cache_aware":  # sent back to the worker holding it: 512 tokens cached each time
        assert again == [512] * 6
    else:  # round robin takes turns whatever the caches hold: some land where their prefix is not
        assert 0 in again and 512 in again
    # A cached prompt's first token comes sooner than its tenant's first one did.
    hit = next(r for r in requests if r.cached_tokens)
    assert hit.first_token - hit.arrival < requests[0].first_token - requests[0].arrival


def test_a_prompt_arriving_while_its_prefix_is_computed_finds_it_cached_when_scheduled():
    """As the engine's scheduler, the simulator reads a prompt's prefix cache hit when it first
    schedules the prompt, not when it arrives: a second prompt of a tenant, arriving while the first
    one's step runs, computes only its own tokens in the next step."""
    p = synthetic_profile()
    shared = prompt(1, 256)
    a, b = Simulator(p, Deployment(0, 1)).run(
        [SimRequest(0.0, shared + prompt(2, 32), 1), SimRequest(0.001, shared + prompt(3, 32), 1)]
    )
    assert a.cached_tokens == 0 and b.cached_tokens == 256
    assert b.first_token == pytest.approx(a.first_token + p.prefill_s(32, 256), rel=0, abs=1e-12)


def test_a_prefix_evicted_between_arrival_and_scheduling_is_computed():
    """The other way round: a prompt that found its prefix cached on arrival, evicted by the step
    that ran meanwhile, computes it when scheduled."""
    p = synthetic_profile(num_blocks=20)  # b's 19 blocks evict a's 9
    a, b, c = Simulator(p, Deployment(0, 1)).run(
        [
            SimRequest(0.0, prompt(1, 160), 1),
            SimRequest(1.0, prompt(2, 320), 1),
            SimRequest(1.001, prompt(1, 160), 1),  # a's prompt again, while b computes
        ]
    )
    assert a.cached_tokens == 0 and c.cached_tokens == 0  # a found none; c lost what it found
    assert c.first_token == pytest.approx(b.first_token + p.prefill_s(160, 0), rel=0, abs=1e-12)


def test_a_prompt_under_the_local_prefill_threshold_is_prefilled_on_its_decode_worker():
    p = synthetic_profile()
    sim = Simulator(p, Deployment(1, 1, local_prefill_tokens=64))
    short, long = sim.run([SimRequest(0.0, prompt(1, 48), 3), SimRequest(10.0, prompt(2, 400), 3)])
    prefill, decode = sim.prefills[0], sim.decodes[0]
    assert len(prefill.cache.blocks) == 399 // BS  # only the long prompt's blocks (before its last token)
    # The short prompt never moved: its second token comes one decode step after its first.
    assert short.token_times[1] - short.first_token == pytest.approx(p.decode_step_s(1, 49), rel=0, abs=1e-12)
    assert long.token_times[1] - long.first_token > p.transfer_s(400)
    assert len(decode.cache.blocks) == 47 // BS + 399 // BS  # both prompts' blocks where they decode


def test_aggregated_deployments_prefill_on_the_decode_workers():
    p = synthetic_profile()
    requests = [SimRequest(0.1 * i, prompt(i, 128), 8) for i in range(6)]
    sim = Simulator(p, Deployment(0, 2))
    sim.run(requests)
    assert all(r.done is not None and len(r.token_times) == 8 for r in requests)
    assert {r.first_token > r.arrival for r in requests} == {True}
    assert sum(len(d.cache.blocks) for d in sim.decodes) == 6 * (127 // BS)


def test_a_full_decode_pool_makes_the_next_request_wait_for_blocks():
    p = synthetic_profile(num_blocks=20)  # one 200 + 100 token request takes 19 blocks
    a, b = Simulator(p, Deployment(1, 1)).run(
        [SimRequest(0.0, prompt(1, 200), 100), SimRequest(0.0, prompt(2, 200), 100)]
    )
    assert b.token_times[1] > a.done  # b decodes only once a's blocks are free


def test_summary_percentiles_throughput_and_goodput():
    reqs = [SimRequest(float(i), [1], 3, first_token=i + 0.1 * (i + 1), token_times=[]) for i in range(10)]
    for r in reqs:
        r.token_times = [r.first_token, r.first_token + 0.05, r.first_token + 0.10]
    s = summarize(reqs, ttft_slo=0.55, itl_slo=0.06)
    assert s.ttft_p50 == pytest.approx(0.6) and s.ttft_p90 == pytest.approx(1.0)
    assert s.itl_p50 == pytest.approx(0.05)
    span = reqs[-1].token_times[-1] - 0.0
    assert s.throughput == pytest.approx(10 / span)
    assert s.goodput == pytest.approx(5 / span)  # TTFTs 0.1 .. 0.5 meet the SLO


def test_an_impossible_deployment_is_refused():
    with pytest.raises(ValueError, match="decode >= 1"):
        Deployment(1, 0)


def test_hop_medians_say_where_a_request_waited_and_computed():
    """The simulator's hops, named as a served request's timing names them: the second of two
    prompts sent together waits out the first's step; the KV moves for the profile's transfer time;
    an idle decode worker starts at once. Aggregated, the same time is the decode worker's own."""
    p = synthetic_profile(budget=200)  # one prompt a step
    a, b = Simulator(p, Deployment(1, 1)).run(
        [SimRequest(0.0, prompt(1, 200), 3), SimRequest(0.0, prompt(2, 200), 3)]
    )
    assert a.marks["prompt_step"] == 0.0 and b.marks["prompt_step"] == pytest.approx(a.first_token)
    hops = hop_medians([a], disaggregated=True)
    assert hops["prefill_queue"] == 0.0
    assert hops["prefill_compute"] == pytest.approx(p.prefill_s(200) * 1e3)
    assert hops["kv_transfer"] == pytest.approx(p.transfer_s(200) * 1e3)
    assert hops["decode_queue"] == pytest.approx(0.0, abs=1e-9) and hops["ttft"] == hops["prefill_compute"]
    assert hop_medians([b], disaggregated=True)["prefill_queue"] == pytest.approx(a.first_token * 1e3)
    [c] = Simulator(p, Deployment(0, 1)).run([SimRequest(1.0, prompt(3, 200), 3)])
    agg = hop_medians([c], disaggregated=False)
    assert set(agg) == {"ttft", "decode_queue", "decode_first_step"}
    assert agg["decode_first_step"] == pytest.approx(p.prefill_s(200) * 1e3) and agg["decode_queue"] == 0.0
