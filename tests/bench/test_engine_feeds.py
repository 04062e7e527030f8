"""How the engine-alone baselines feed the engine: ``engine_closed_loop`` adds requests in cohorts
(all in flight before the first step, a replacement the moment one ends), ``engine_staggered_loop``
as a served engine receives them (one joins per step until the loop is full, then each ending is
replaced at once), so that arrivals spread over the steps. Both run every prompt to its end."""

from __future__ import annotations

import pytest

from bench.serving_comparisons import engine_closed_loop, engine_staggered_loop
from engine import EngineConfig, EngineCore, SamplingParams


class JoinsPerStep:
    """An engine core that counts the requests added before each step."""

    def __init__(self, core: EngineCore) -> None:
        self.core, self.joins, self.finished, self._pending = core, [], 0, 0

    def add_request(self, *args, **kw) -> None:
        self._pending += 1
        self.core.add_request(*args, **kw)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def step(self):
        self.joins.append(self._pending)
        self._pending = 0
        outs = self.core.step()
        self.finished += sum(o.finished for o in outs)
        return outs


@pytest.fixture
def feed(tiny_llama):
    core = EngineCore(EngineConfig(model=str(tiny_llama), num_blocks=256, block_size=4))
    prompts = [[3 + (i * 5 + j) % 400 for j in range(6 + i % 5)] for i in range(40)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)  # none ends during the ramp

    def run(loop) -> JoinsPerStep:
        counted = JoinsPerStep(core)
        assert loop(counted, prompts, params, concurrency=8) > 0
        assert counted.finished == len(prompts) and sum(counted.joins) == len(prompts)
        stats = core.stats()
        assert stats.num_free_blocks == stats.num_blocks
        return counted

    return run


def _share_of_steps_with_arrivals(joins: list[int]) -> float:
    """Of the steps up to the last arrival, the share that took a request in."""
    last = max(i for i, j in enumerate(joins) if j)
    return sum(1 for j in joins[: last + 1] if j) / (last + 1)


def test_the_staggered_feed_spreads_arrivals_over_the_steps(feed):
    staggered = feed(engine_staggered_loop).joins
    assert staggered[:8] == [1] * 8  # the ramp: one joins per step
    assert max(staggered) <= 2
    # Arrivals keep spreading: until the last one, most steps take a request in.
    assert _share_of_steps_with_arrivals(staggered) >= 0.6


def test_the_closed_loop_adds_cohorts(feed):
    cohort = feed(engine_closed_loop).joins
    assert cohort[0] == 8 and max(cohort) == 8
    assert _share_of_steps_with_arrivals(cohort) <= 0.3


def test_the_instruction_count_workload_runs_both_feeds(capsys):
    """``bench.step_instructions`` (what ``bench/step_instructions_ab.sh`` counts under valgrind):
    the zero-cost engine alone, warmed up, then the feed's requests; 0 requests runs no step."""
    from bench import step_instructions

    assert step_instructions.main(["cohorts", "0"]) == 0
    cohorts = step_instructions.main(["cohorts", "96"])
    staggered = step_instructions.main(["staggered", "96"])
    assert cohorts > 0 and staggered > 0
    assert capsys.readouterr().out.split() == ["steps", "0", "steps", str(cohorts), "steps", str(staggered)]
