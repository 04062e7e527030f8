"""Preemption keeps arrival order under steady traffic: nothing new is admitted while a swapped-out
sequence waits to come back (new prompts took its blocks a few at a time, and it waited out the
traffic); a sequence preempted for recompute goes back to the head of the queue."""

from __future__ import annotations

import random

import pytest

from engine import EngineConfig, EngineCore, SamplingParams

ARRIVALS_UNTIL = 240  # steps of steady traffic: a short request every other step


@pytest.mark.parametrize("swap_space", [0.01, 0.0], ids=["swap", "recompute"])
def test_an_early_request_is_not_starved_by_later_ones(tiny_llama, swap_space):
    rng = random.Random(8)
    prompt = lambda n: [rng.randrange(3, 200) for _ in range(n)]  # noqa: E731
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731
    core = EngineCore(EngineConfig(model=str(tiny_llama), block_size=4, num_blocks=24, swap_space=swap_space))
    core.add_request("B", prompt(20), greedy(40))
    core.step()
    core.add_request("A", prompt(20), greedy(40))  # second: the pool cannot hold both at full length
    finished, step, later = {}, 0, 0
    while core.has_unfinished():
        step += 1
        if step % 2 == 0 and step <= ARRIVALS_UNTIL:
            core.add_request(f"s{later}", prompt(4), greedy(16))
            later += 1
        for o in core.step():
            if o.finished:
                finished[o.request_id] = step
    assert core.scheduler.num_preemptions > 0  # the pool is tight: the order is what is tested
    before_a = sorted(k for k in finished if k.startswith("s") and finished[k] < finished["A"])
    # A finishes with the requests of its time, well before the traffic ends (it was step ~520 of 500).
    assert finished["A"] < ARRIVALS_UNTIL // 2 and len(before_a) < 10, (finished["A"], before_a)
    assert core.stats().num_free_blocks == 24
