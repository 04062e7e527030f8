"""A sequence swapped in is never swapped out again in the same step.

Under ``fair`` the swapped sequences come back before the running prefills are scheduled. One
swapped in whose first chunk then does not fit stays unscheduled this step; were it then chosen to
make room for a prefill, its swap-out would be applied before its swap-in (the runner's order) and
copy blocks the swap-in had not written yet: a later step reads wrong KV. The KV-checking driver
catches such a read.
"""

from __future__ import annotations

import random

import pytest

from engine.request import Request
from engine.sampling_params import SamplingParams
from tests.engine.scheduler_driver import Driver, make_prompt, seq_token


def _churn_with_swaps(seed: int, num_blocks: int, budget: int, max_seqs: int, loras: list) -> Driver:
    rng = random.Random(seed)
    d = Driver(
        num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
        policy="fair", num_cpu_blocks=64, step_seconds=lambda o: 0.0005 * o.total_num_scheduled_tokens + 0.01,
    )  # fmt: skip
    d.sched.max_loras = 1
    for t in range(3000):
        if t < 200 and rng.random() < 0.4:
            rid, plen = f"r{t}", rng.randrange(2, 40)
            stop = [seq_token(rid, plen + rng.randrange(1, 20))] if rng.random() < 0.3 else []
            lora = rng.choice(loras)
            params = SamplingParams(max_tokens=rng.randrange(2, 30), stop_token_ids=stop)
            extra = {"lora": lora, "lora_salt": lora} if lora else {}
            d.sched.add(
                Request(rid, make_prompt(rid, plen), params, seed=0, eos_token_ids=frozenset(),
                        arrival_time=float(t), **extra)
            )  # fmt: skip
        if t >= 200 and not d.sched.has_unfinished():
            break
        d.step()
    return d


@pytest.mark.parametrize("seed", range(6))
def test_fair_batching_with_swaps_reads_only_the_kv_it_wrote(seed):
    """Tight pools and budgets, a swap space and adapters taking turns: every step's reads are
    checked against what was written, and the run drains with every block back."""
    d = _churn_with_swaps(seed, num_blocks=32 if seed % 2 else 20, budget=8 if seed % 3 else 16, max_seqs=10,
                          loras=[None, "a", "b", "c"])  # fmt: skip
    assert d.sched.num_swap_outs > 0
    d.assert_drained()
