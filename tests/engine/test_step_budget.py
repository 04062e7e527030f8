"""The step budget a stall is judged against (``engine.step_budget``): a step scheduled with many
tokens announces its length before it runs, from the engine's cost per token (or a cold default),
and the engine tells the budget each step's tokens once it has scheduled them."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from engine.step_budget import COLD_TOKEN_S, StepBudget


def test_a_step_with_many_tokens_announces_its_length_before_it_runs():
    b = StepBudget()
    assert b.budget_s == 0.0
    b.started(2048)  # a cold engine: no large step timed yet
    assert b.budget_s == pytest.approx(2048 * COLD_TOKEN_S)
    b.finished(4.0)  # it took 4 s: ~2 ms a token
    assert b.budget_s == pytest.approx(4.0) and b.token_s == pytest.approx(4.0 / 2048)
    for _ in range(500):  # short decode steps: the long one fades from the recent steps
        b.started(8)
        b.finished(0.01)
    assert b.budget_s < 0.1
    b.started(4096)  # the next long prompt is announced at the learned rate, not the cold one
    assert b.budget_s == pytest.approx(4096 * 4.0 / 2048)
    b.finished(8.0)
    assert b.expected_s == 0.0 and b.budget_s == pytest.approx(8.0)


def test_small_steps_do_not_teach_a_cost_per_token():
    b = StepBudget()
    b.started(32)
    b.finished(0.5)  # a slow small step (overhead): 16 ms a token, not a prefill's rate
    b.started(2048)
    assert b.budget_s == pytest.approx(2048 * COLD_TOKEN_S)


def test_the_engine_tells_the_budget_each_steps_tokens_once_scheduled(tiny_model_factory):
    core = EngineCore(EngineConfig(model=str(tiny_model_factory()), max_num_batched_tokens=64))
    seen: list[float] = []
    core.step_budget = StepBudget(on_start=lambda: seen.append(core.step_budget.expected_s))
    core.add_request("a", list(range(3, 100)), SamplingParams(temperature=0, max_tokens=2))
    core.step()  # 64 of the 97 prompt tokens (chunked)
    core.step()  # the other 33
    assert seen == pytest.approx([64 * COLD_TOKEN_S, 33 * COLD_TOKEN_S])
    assert core.step_budget.tokens == 33
