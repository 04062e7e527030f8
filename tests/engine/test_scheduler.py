"""Scheduler driven on CPU by a fake runner that also checks, in a simulated KV cache, that every
sequence reads back the KV of its own tokens (so lost swaps, bad copies or wrong block tables fail).
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
from scheduler_driver import Driver, make_prompt, seq_token

from engine.request import RequestStatus


def test_long_prompt_runs_in_chunks_within_the_token_budget() -> None:
    d = Driver(max_num_batched_tokens=16)
    d.add("long", 50, max_tokens=3)
    for _ in range(3):
        d.step()
        assert d.outputs.get(("long", 0)) is None  # partial chunks sample nothing
    d.step()
    assert len(d.outputs[("long", 0)]) == 1  # the first token comes with the last chunk
    d.run()
    assert d.scheduled("long") == [16, 16, 16, 2, 1, 1]
    assert d.outputs[("long", 0)] == [seq_token("long", 50), seq_token("long", 51), seq_token("long", 52)]
    assert d.finish_reasons[("long", 0)] == "length"
    d.assert_drained()


def test_many_requests_share_the_budget_and_all_finish() -> None:
    d = Driver(max_num_batched_tokens=16)
    for i in range(8):
        d.add(f"r{i}", 10 + i, max_tokens=5)
    d.run()
    totals = [s.total_num_scheduled_tokens for s in d.steps]
    assert max(totals) == 16  # the budget is filled, and (checked every step) never exceeded
    assert {k: len(v) for k, v in d.outputs.items()} == {(f"r{i}", 0): 5 for i in range(8)}
    d.assert_drained()


def test_max_num_seqs_caps_the_running_batch() -> None:
    d = Driver(max_num_seqs=2)
    for i in range(5):
        d.add(f"r{i}", 6, max_tokens=4)
    while d.sched.has_unfinished():
        d.step()
        assert len(d.sched.running) <= 2
    assert all(len(d.outputs[(f"r{i}", 0)]) == 4 for i in range(5))
    d.assert_drained()


def test_fifo_serves_decodes_then_running_prefills_then_new_requests() -> None:
    d = Driver(max_num_batched_tokens=8)
    d.add("decoder", 3, max_tokens=10)
    d.add("prefiller", 10, max_tokens=2)
    assert list(d.step().num_scheduled_tokens.items()) == [("decoder", 3), ("prefiller", 5)]
    d.add("newcomer", 3, max_tokens=2)
    assert list(d.step().num_scheduled_tokens.items()) == [("decoder", 1), ("prefiller", 5), ("newcomer", 2)]
    d.run()
    d.assert_drained()


def test_prefill_first_runs_prompts_before_decodes() -> None:
    d = Driver(max_num_batched_tokens=8, policy="prefill_first")
    d.add("decoder", 3, max_tokens=10)
    d.step()
    d.add("prompt", 20, max_tokens=2)
    # The new prompt takes the whole budget; the running decode waits until it is (almost) done.
    assert [list(d.step().num_scheduled_tokens.items()) for _ in range(3)] == [
        [("prompt", 8)],
        [("prompt", 8)],
        [("prompt", 4), ("decoder", 1)],
    ]
    d.run()
    d.assert_drained()


def test_priority_policy_admits_lower_values_first() -> None:
    d = Driver(max_num_seqs=1, policy="priority")
    d.add("low", 4, max_tokens=2, priority=5)
    d.add("mid", 4, max_tokens=2, priority=2)
    d.add("high", 4, max_tokens=2, priority=0)
    d.run()
    first_step = {rid: next(i for i, n in enumerate(d.scheduled(rid)) if n) for rid in ("low", "mid", "high")}
    assert first_step["high"] < first_step["mid"] < first_step["low"]
    d.assert_drained()


@pytest.mark.parametrize(("policy", "victim"), [("fifo", "late"), ("priority", "early_low")])
def test_running_sequence_short_of_blocks_preempts_latest_or_lowest_priority(
    policy: str, victim: str
) -> None:
    d = Driver(num_blocks=6, policy=policy)
    early = d.add("early_low", 4, max_tokens=12, priority=5)
    late = d.add("late", 4, max_tokens=12, priority=0)
    d.run()
    preempted = {r.request_id for r in (early, late) if r.num_preemptions}
    assert preempted == {victim}
    assert all(len(d.outputs[(rid, 0)]) == 12 for rid in ("early_low", "late"))
    d.assert_drained()


def test_high_priority_arrival_preempts_low_priority_request_when_blocks_are_short() -> None:
    d = Driver(num_blocks=8, policy="priority")
    low = d.add("low", 20, max_tokens=12, priority=5)
    d.step()
    d.step()
    d.add("high", 16, max_tokens=4, priority=0)  # needs 4 blocks; only 2 are free
    d.run()
    high_done = max(i for i, n in enumerate(d.scheduled("high")) if n)
    low_done = max(i for i, n in enumerate(d.scheduled("low")) if n)
    assert low.num_preemptions >= 1
    assert high_done < low_done
    d.assert_drained()


def test_recompute_preemption_requeues_the_latest_arrival_at_the_front() -> None:
    d = Driver(num_blocks=6)
    d.add("a", 8, max_tokens=8)
    b = d.add("b", 8, max_tokens=8)
    d.add("c", 12, max_tokens=4)  # 3 blocks: does not fit next to a and b
    out = d.step_until_preemption()
    assert "b" in out.finished_seq_ids and b.num_preemptions == 1  # the runner drops its state
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert [r.request_id for r in d.sched.waiting] == ["b", "c"]
    generated = list(b.output_token_ids)
    d.run()
    # b is resent in full (prompt and the tokens it had) and recomputed from its cached prefix.
    resent = next(n for s in d.steps for n in s.new_seqs if n.seq_id == "b" and len(n.token_ids) > 8)
    assert resent.token_ids == make_prompt("b", 8) + generated
    assert {k: len(v) for k, v in d.outputs.items()} == {("a", 0): 8, ("b", 0): 8, ("c", 0): 4}
    d.assert_drained()


def test_swap_preemption_moves_blocks_to_cpu_and_back() -> None:
    d = Driver(num_blocks=6, num_cpu_blocks=16)
    d.add("a", 8, max_tokens=8)
    b = d.add("b", 8, max_tokens=8)
    out = d.step_until_preemption()
    assert b.status == RequestStatus.SWAPPED and list(d.sched.swapped) == [b]
    assert b.num_computed_tokens > 0  # nothing to recompute
    gpu_out = [g for g, _ in out.blocks_to_swap_out]
    cpu_out = [c for _, c in out.blocks_to_swap_out]
    assert len(gpu_out) == 3
    d.run()
    swap_in = next(s.blocks_to_swap_in for s in d.steps if s.blocks_to_swap_in)
    assert [c for c, _ in swap_in] == cpu_out
    assert {k: len(v) for k, v in d.outputs.items()} == {("a", 0): 8, ("b", 0): 8}
    d.assert_drained()


def test_sequence_swapped_out_with_most_of_the_pool_comes_back() -> None:
    d = Driver(num_blocks=10, num_cpu_blocks=64, admission_margin=0.1)
    d.add("short", 2, max_tokens=6)
    d.add("big", 32, max_tokens=8)  # 40 tokens = the whole pool; swapped out holding 9 blocks
    d.run(max_steps=100)
    assert len(d.outputs[("big", 0)]) == 8
    d.assert_drained()


def test_swapped_sequence_reads_back_its_own_kv_with_prefill_first() -> None:
    d = Driver(num_blocks=4, num_cpu_blocks=32, policy="prefill_first")
    d.add("r0", 4, max_tokens=8)
    d.add("r1", 5, max_tokens=8)
    d.add("r2", 4, max_tokens=8)
    for _ in range(100):
        if not d.sched.has_unfinished():
            break
        out = d.sched.schedule()
        read = {c for c, _ in out.blocks_to_swap_in}
        written = {c for _, c in out.blocks_to_swap_out}
        assert not read & written, f"CPU blocks {read & written} swapped out before being swapped in"
        d.sched.update(out, d.runner(out))
    d.assert_drained()


@pytest.mark.parametrize(("margin", "big_starts_at_once"), [(0.1, False), (0.0, True)])
def test_admission_margin_holds_back_new_requests_while_others_run(
    margin: float, big_starts_at_once: bool
) -> None:
    d = Driver(num_blocks=100, max_num_batched_tokens=512, admission_margin=margin)
    d.add("small", 4, max_tokens=4)
    d.add("big", 360, max_tokens=1)  # 90 of 100 blocks
    d.run()
    big_first = d.scheduled("big").index(360)
    small_last = max(i for i, n in enumerate(d.scheduled("small")) if n)
    assert (big_first == 0) is big_starts_at_once
    if not big_starts_at_once:
        assert big_first == small_last + 1  # admitted as soon as nothing else runs
    d.assert_drained()


def test_prefix_cache_hit_skips_the_shared_prompt_blocks() -> None:
    d = Driver()
    d.add("first", 13, max_tokens=2)
    d.run()
    d.add("again", make_prompt("first", 13), max_tokens=2)
    new = d.step().new_seqs[0]
    assert new.num_computed_tokens == 12  # three cached blocks; the last prompt token runs again
    assert d.scheduled("again")[-1] == 1
    d.run()
    assert d.kv.prefix_hits == 12 and d.kv.prefix_queries == 26
    d.assert_drained()


def test_parallel_samples_fork_after_the_prompt_and_share_its_blocks() -> None:
    d = Driver(max_num_batched_tokens=4)
    d.add("r", 10, max_tokens=5, n=3)
    for _ in range(2):
        d.step()
        assert d.sched.sequences_of("r") == ["r"]  # no forks during partial chunks
    last_chunk = d.step()
    assert [data.num_samples for data in last_chunk.running_seqs] == [3]
    assert d.sched.sequences_of("r") == ["r", "r#1", "r#2"]
    table = list(d.kv.tables["r"])
    assert d.kv.tables["r#1"] == d.kv.tables["r#2"] == table
    assert [d.kv.pool.ref_cnt[b] for b in table] == [3, 3, 3]
    # Everyone writes its next token into the shared partial block: the first two get copies.
    copies = d.step().blocks_to_copy
    assert [src for src, _ in copies] == [table[2], table[2]]
    assert [d.kv.pool.ref_cnt[b] for b in d.kv.tables["r"][:2]] == [3, 3]
    d.run()
    assert {k: len(v) for k, v in d.outputs.items()} == {("r", 0): 5, ("r", 1): 5, ("r", 2): 5}
    assert all(d.outputs[("r", i)][0] == seq_token("r", 10) for i in range(3))
    d.assert_drained()


def test_one_parallel_sample_can_finish_while_the_others_go_on() -> None:
    d = Driver()
    d.add("r", 6, max_tokens=6, n=2)
    d.step()
    d.step()
    assert d.sched.finish("r#1", RequestStatus.FINISHED_ABORTED) is not None
    assert "r#1" in d.step().finished_seq_ids  # the runner is told to drop it
    d.run()
    assert len(d.outputs[("r", 0)]) == 6 and len(d.outputs[("r", 1)]) == 2
    d.assert_drained()


def test_parallel_samples_count_against_max_num_seqs() -> None:
    d = Driver(max_num_seqs=2)
    d.add("a", 4, max_tokens=4, n=2)
    d.add("b", 4, max_tokens=4, n=2)
    d.run()  # Driver.step checks every step's sequence count against max_num_seqs
    d.assert_drained()


@pytest.mark.parametrize("seed", range(80))
def test_random_workload_finishes_with_correct_kv_and_frees_every_block(seed: int) -> None:
    # Every policy with swapping, forks under a small max_num_seqs, and an admission margin.
    rng = random.Random(seed)
    policy = rng.choice(["fifo", "prefill_first", "priority", "fair"])
    forks = rng.random() < 0.5
    d = Driver(
        num_blocks=rng.randint(12, 40),
        block_size=rng.choice([2, 4]),
        max_num_batched_tokens=rng.choice([6, 16, 64]),
        max_num_seqs=rng.choice([4, 8, 64]) if forks else rng.choice([2, 4, 8]),
        policy=policy,
        num_cpu_blocks=rng.choice([0, 64]),
        admission_margin=rng.choice([0.0, 0.1]),
        # fair: steps cost 1 ms + 0.1 ms a token against a 3 ms target (prefill chunks of ~20 tokens).
        itl_target_ms=3.0,
        step_seconds=lambda step: 0.001 + 0.0001 * step.total_num_scheduled_tokens,
    )
    shared = make_prompt("shared", 30)  # common prefixes exercise the prefix cache
    arrivals: dict[int, list[tuple[str, list[int], int, int]]] = defaultdict(list)
    expected: dict[tuple[str, int], int] = {}
    for i in range(rng.randint(3, 10)):
        plen, max_tokens, n = rng.randint(1, 30), rng.randint(1, 12), rng.choice([1, 2, 3]) if forks else 1
        if d.kv.blocks_needed(plen + max_tokens) > d.kv.num_blocks:
            continue  # EngineCore refuses these
        prompt = shared[: rng.randint(0, plen)] + make_prompt(f"r{i}", plen)
        arrivals[rng.randint(0, 10)].append((f"r{i}", prompt[:plen], max_tokens, n))
        expected.update({(f"r{i}", k): max_tokens for k in range(n)})
    for step in range(11):
        for rid, prompt, max_tokens, n in arrivals[step]:
            d.add(rid, prompt, max_tokens, n=n, priority=rng.randint(0, 3))
        d.step()
    d.run()
    assert {k: len(v) for k, v in d.outputs.items()} == expected
    d.assert_drained()


def test_a_decode_in_its_own_block_travels_as_list_entries_and_a_new_block_as_its_one_id() -> None:
    """The fast path's contract, which the runner builds its batch from: a decode whose token fits a
    block it alone owns is an entry of ``decode_ids`` / ``decode_positions`` only; a decode whose
    token opens a block is one too, with that one new block id in ``decode_new_blocks``; the
    batch's KV stays right (the checking runner reads it back every step)."""
    d = Driver(block_size=4)
    d.add("a", 5, max_tokens=20)
    d.step()  # the prompt, and its first token: position 5 decodes next
    for pos in range(5, 12):
        before = list(d.kv.tables["a"])
        out = d.step()
        after = d.kv.tables["a"]
        assert (out.decode_ids, out.decode_positions, out.running_seqs) == (["a"], [pos], [])
        if pos % 4:
            assert out.decode_new_blocks == {} and after == before
        else:
            assert out.decode_new_blocks == {"a": after[-1]}
            assert after[:-1] == before and len(after) == len(before) + 1
        assert out.num_scheduled_tokens == {"a": 1}
    d.run()
    d.assert_drained()


def test_samples_sharing_their_last_block_leave_the_fast_path_until_they_own_one() -> None:
    """Parallel samples fork with the prompt's partly filled last block shared: their next decodes
    copy it (a whole new table), not the fast path; after that each owns its block and decodes fast."""
    d = Driver(block_size=4)
    d.add("p", 5, max_tokens=6, n=2)
    d.step()  # the prompt; the sample forks
    out = d.step()
    moved = {r.seq_id for r in out.running_seqs if r.block_ids is not None}
    assert moved and not moved & set(out.decode_ids)  # the copy-on-write took the general path
    out = d.step()
    assert sorted(out.decode_ids) == ["p", "p#1"] and out.running_seqs == []
    d.run()
    assert len(d.outputs[("p", 0)]) == len(d.outputs[("p", 1)]) == 6
    d.assert_drained()
