"""The ``fair`` scheduling policy: a step's prefill allowance sized from measured step times to an ITL
target, decodes never starved, prefill's guaranteed share, and least-attained-service among prompts.

Step durations are injected (a cost model of the step's size), never measured: nothing here is timed.
"""

from __future__ import annotations

import pytest
from scheduler_driver import Driver

from engine.batching_policy import FairBatching
from engine.config import EngineConfig
from engine.scheduler_output import SchedulerOutput


def linear_cost(fixed_s: float, per_token_s: float):
    """A step that costs ``fixed_s`` plus ``per_token_s`` per scheduled token."""
    return lambda step: fixed_s + per_token_s * step.total_num_scheduled_tokens


def feed(policy: FairBatching, fixed_s: float, per_token_s: float, sizes=(8, 40, 8, 120, 8, 70)) -> None:
    for _ in range(20):
        for n in sizes:
            policy.observe(n, fixed_s + per_token_s * n)


# The policy alone ------------------------------------------------------------------------------


def test_before_any_step_and_without_decodes_the_whole_budget_goes_to_prefill() -> None:
    policy = FairBatching(2048, itl_target_s=0.1)
    assert policy.capacity == 2048
    feed(policy, 0.05, 0.01)  # slow steps: a 10-token step already misses the target
    assert policy.capacity < 10
    assert policy.prefill_budget(0) == 2048  # no decode waits on this step


def test_capacity_is_what_the_fitted_step_cost_predicts_fits_the_target() -> None:
    policy = FairBatching(2048, itl_target_s=0.1)
    feed(policy, 0.010, 0.0005)
    fixed, per_token = policy.cost_model()
    assert fixed == pytest.approx(0.010) and per_token == pytest.approx(0.0005)
    assert policy.capacity == 180  # (100 - 10) ms / 0.5 ms
    assert policy.prefill_budget(8) == 172  # the decodes' tokens come out of the capacity


def test_capacity_shrinks_when_steps_get_slow_and_grows_back_when_fast() -> None:
    policy = FairBatching(2048, itl_target_s=0.1)
    feed(policy, 0.010, 0.0002)
    fast = policy.capacity
    feed(policy, 0.030, 0.0010)  # e.g. another process now shares the device
    slow = policy.capacity
    feed(policy, 0.010, 0.0002)
    assert slow < fast / 3
    assert policy.capacity >= 0.98 * fast


def test_steps_all_of_one_size_charge_all_time_per_token() -> None:
    # Decode-only history cannot tell fixed from per-token cost: the estimate errs small, and the
    # first mixed step it allows gives the fit its spread.
    policy = FairBatching(2048, itl_target_s=0.1)
    for _ in range(50):
        policy.observe(8, 0.020)
    assert policy.cost_model() == (0.0, pytest.approx(0.0025))
    assert policy.capacity == 40
    policy.observe(40, 0.020 + 32 * 0.0005)
    assert policy.capacity > 100


def test_prefill_keeps_its_guaranteed_share_when_decodes_fill_the_capacity() -> None:
    policy = FairBatching(2048, itl_target_s=0.05, min_prefill_share=0.25, min_prefill_tokens=16)
    feed(policy, 0.040, 0.0005)  # capacity 20 tokens
    assert policy.capacity == 20
    assert policy.prefill_budget(8) == 16  # the minimum chunk
    assert policy.prefill_budget(300) == 100  # a quarter of the step's tokens: 100 of 400
    assert policy.prefill_budget(2040) == 8  # never past max_num_batched_tokens


@pytest.mark.parametrize(
    "kwargs",
    [
        {"itl_target_s": 0},
        {"itl_target_s": 0.1, "min_prefill_share": 1.0},
        {"itl_target_s": 0.1, "memory": 1},
    ],
)
def test_bad_settings_are_refused(kwargs) -> None:
    with pytest.raises(ValueError):
        FairBatching(2048, **kwargs)


@pytest.mark.parametrize("target", [0, -5.0, float("nan"), "fast"])
def test_engine_config_refuses_a_target_that_is_not_a_positive_number(target) -> None:
    with pytest.raises(ValueError, match="itl_target_ms"):
        EngineConfig(model="m", scheduling_policy="fair", itl_target_ms=target)


# In the scheduler ------------------------------------------------------------------------------


def decoding(d: Driver) -> set[str]:
    return {r.request_id for r in d.sched.running if r.num_tokens - r.num_computed_tokens == 1}


def step_checking_decodes(d: Driver) -> SchedulerOutput:
    before = decoding(d)
    out = d.step()
    assert {s: out.num_scheduled_tokens.get(s) for s in before} == dict.fromkeys(before, 1)
    return out


def test_decodes_run_every_step_while_long_prompts_prefill_in_chunks() -> None:
    # 10 ms + 1 ms a token against a 40 ms target: room for 30 tokens a step.
    d = Driver(
        max_num_batched_tokens=512,
        num_blocks=256,
        policy="fair",
        itl_target_ms=40,
        step_seconds=linear_cost(0.010, 0.001),
    )
    for i in range(6):
        d.add(f"chat{i}", 8, max_tokens=40)
    step_checking_decodes(d)  # nobody decodes yet: all six prompts in one step
    d.add("long", 300, max_tokens=2)
    mixed = []
    while d.sched.has_unfinished():
        out = step_checking_decodes(d)
        if len(out.num_scheduled_tokens) > 1 and "long" in out.num_scheduled_tokens:
            mixed.append(out.total_num_scheduled_tokens)
    # The first mixed step is sized by the one step seen so far (all of its time charged per token);
    # from then on the fit is exact and every step carries at most the 30 tokens that fit.
    assert len(mixed) > 10 and max(mixed[1:]) == 30
    assert max(d.scheduled("long")) <= 27 and len(d.outputs[("long", 0)]) == 2
    d.assert_drained()


def test_prefill_gets_its_share_even_when_decodes_alone_miss_the_target() -> None:
    # Every step is far over the 20 ms target: decodes still all run, and the long prompt still gets
    # max(16, a quarter of the step) tokens a step, so it finishes instead of starving.
    d = Driver(
        max_num_batched_tokens=512,
        max_num_seqs=64,
        num_blocks=256,
        policy="fair",
        itl_target_ms=20,
        step_seconds=linear_cost(0.100, 0.002),
    )
    for i in range(48):
        d.add(f"chat{i}", 2, max_tokens=60)
    step_checking_decodes(d)
    d.add("long", 200, max_tokens=1)
    chunks = []
    while ("long", 0) not in d.outputs and len(chunks) < 100:
        chunks.append(step_checking_decodes(d).num_scheduled_tokens.get("long", 0))
    assert chunks == [16] * 12 + [8]  # 48 decodes: max(16, 48 / 3) tokens a step
    d.run()
    d.add("alone", 300, max_tokens=1)
    assert d.step().num_scheduled_tokens == {"alone": 300}  # no decode waits: the whole budget
    d.assert_drained()


def test_short_prompt_is_not_stuck_behind_a_long_one() -> None:
    d = Driver(
        max_num_batched_tokens=512,
        num_blocks=256,
        policy="fair",
        itl_target_ms=30,
        step_seconds=linear_cost(0.010, 0.001),
    )
    d.add("chat", 4, max_tokens=30)
    d.step()
    d.add("long", 400, max_tokens=2)
    d.step()
    d.step()  # the long prompt is mid-prefill, ahead of anything that arrives now
    d.add("short", 12, max_tokens=2)
    out = d.step()
    assert out.num_scheduled_tokens.get("short") == 12  # least attained service: served at once
    assert d.outputs[("short", 0)] and ("long", 0) not in d.outputs
    d.run()
    d.assert_drained()


def test_fifo_under_the_same_chunking_keeps_the_short_prompt_waiting() -> None:
    # The contrast: fifo runs the earlier, running prompt's chunks first.
    d = Driver(max_num_batched_tokens=19)
    d.add("chat", 4, max_tokens=30)
    d.step()
    d.add("long", 400, max_tokens=2)
    d.step()
    d.add("short", 12, max_tokens=2)
    assert "short" not in d.step().num_scheduled_tokens


def long_prompt_chunk(per_token_s: float) -> int:
    """The first chunk of a long prompt arriving next to one decode, once the fit has seen steps of
    several sizes cost 10 ms + ``per_token_s`` a token (50 ms target)."""
    d = Driver(
        max_num_batched_tokens=2048,
        num_blocks=512,
        policy="fair",
        itl_target_ms=50,
        step_seconds=linear_cost(0.010, per_token_s),
    )
    d.add("chat", 4, max_tokens=100)
    for size in (40, 80, 20, 120, 60):
        d.step()
        d.add(f"warm{size}", size, max_tokens=1)
    for _ in range(10):
        d.step()
    d.add("long", 1000, max_tokens=1)
    d.step()
    return d.scheduled("long")[-1]


def test_chunk_size_follows_the_measured_step_cost() -> None:
    assert long_prompt_chunk(0.0001) == 399  # (50 - 10) ms / 0.1 ms = 400 tokens, one of them a decode
    assert long_prompt_chunk(0.0005) == 79  # (50 - 10) ms / 0.5 ms = 80
