"""A steady decode batch in bulk: the scheduler advances the same running decodes by residue
(``engine.steady_decodes``), the runner advances their inputs on the device
(``engine.repeat_inputs``), and ``update`` appends their samples in one loop. Each test runs the
same work with those three switched off (the per-request paths) and compares everything a step
decides, and checks that the bulk paths ran, so a test cannot pass by never taking them."""

from __future__ import annotations

import random

import pytest

from engine import EngineConfig, EngineCore, SamplingParams
from engine.repeat_inputs import RepeatInputs
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from engine.scheduler_output import PlainTokens
from engine.scheduler_results import StepResults
from engine.steady_decodes import SteadyDecodes
from tests.engine.scheduler_driver import Driver, make_prompt, seq_token


class BulkCounts:
    """How often each bulk path ran (and the scheduler's gave way at a block boundary)."""

    def __init__(self, monkeypatch, enabled: bool) -> None:
        self.scheduled = self.refused = self.advanced = self.appended = self.dropped = self.joined = 0
        if not enabled:
            monkeypatch.setattr(Scheduler, "_capture_steady", lambda self, *a: None)
            monkeypatch.setattr(RepeatInputs, "capture", classmethod(lambda cls, *a: None))
            monkeypatch.setattr(StepResults, "_update_steady", lambda self, *a: False)
            return
        advance, device_advance, update = (
            SteadyDecodes.advance,
            RepeatInputs.advance,
            StepResults._update_steady,
        )
        drop, join = SteadyDecodes._drop, SteadyDecodes.join

        def counted_drop(steady, gone):
            self.dropped += len(gone)
            drop(steady, gone)

        def counted_join(steady, tail, out):
            before = len(steady.ids)
            join(steady, tail, out)
            self.joined += len(steady.ids) - before

        def counted_advance(steady, kv, out):
            ok = advance(steady, kv, out)
            self.scheduled += ok
            self.refused += not ok
            return ok

        def counted_device_advance(inputs, *a):
            got = device_advance(inputs, *a)
            self.advanced += got is not None
            return got

        def counted_update(results, *a):
            ok = update(results, *a)
            self.appended += ok
            return ok

        monkeypatch.setattr(SteadyDecodes, "advance", counted_advance)
        monkeypatch.setattr(RepeatInputs, "advance", counted_device_advance)
        monkeypatch.setattr(StepResults, "_update_steady", counted_update)
        monkeypatch.setattr(SteadyDecodes, "_drop", counted_drop)
        monkeypatch.setattr(SteadyDecodes, "join", counted_join)


# The scheduler, on the KV-checking driver ----------------------------------------------------------


def _decisions(d: Driver, out) -> tuple:
    """Everything a scheduler step decided, and the pool's cache after it."""
    return (
        list(out.decode_ids), list(out.decode_positions), dict(out.num_scheduled_tokens),
        dict(out.decode_new_blocks), [s.seq_id for s in out.new_seqs], sorted(out.finished_seq_ids),
        list(d.kv.pool.block_hash), d.sched.num_preemptions,
    )  # fmt: skip


def _drive(policy: str, num_blocks: int, seed: int) -> tuple[list[tuple], Driver]:
    """A staggered workload (prompts of every residue mod the block size, lengths that end at
    different steps, arrivals while others decode); every step's decisions and the pool's cache."""
    rng = random.Random(seed)
    d = Driver(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=48, max_num_seqs=8, policy=policy)
    arrivals = {0: 5, 9: 1, 23: 2, 40: 1}
    steps: list[tuple] = []
    for t in range(400):
        for _ in range(arrivals.get(t, 0)):
            i = d._num_added
            d.add(f"r{i}", rng.randrange(3, 14), max_tokens=rng.randrange(6, 40))
        if t > max(arrivals) and not d.sched.has_unfinished():
            break
        out = d.step()
        steps.append(_decisions(d, out))
    d.assert_drained()
    return steps, d


@pytest.mark.parametrize("policy", ["fifo", "fair", "prefill_first"])
@pytest.mark.parametrize("num_blocks", [64, 14])
def test_steady_scheduling_decides_every_step_as_the_per_request_path(monkeypatch, policy, num_blocks):
    """Positions, block ids opened, blocks cached once full (their hashes), preemptions (14 blocks:
    a steady step runs out of blocks at a boundary and gives way) and outputs, step by step."""
    with monkeypatch.context() as m:
        BulkCounts(m, enabled=False)
        ref_steps, ref = _drive(policy, num_blocks, seed=num_blocks)
    counts = BulkCounts(monkeypatch, enabled=True)
    steps, got = _drive(policy, num_blocks, seed=num_blocks)
    for i, (want, have) in enumerate(zip(ref_steps, steps)):
        assert have == want, f"step {i} differs"
    assert len(steps) == len(ref_steps)
    assert got.outputs == ref.outputs and got.finish_reasons == ref.finish_reasons
    assert counts.scheduled >= 20 and counts.appended >= 20
    if num_blocks == 14:
        assert ref.sched.num_preemptions > 0 and counts.refused > 0


def _churn(policy: str, num_blocks: int, seed: int, longest_prompt: int = 12) -> tuple[list[tuple], Driver]:
    """Requests arriving while others decode and ending at scattered steps (a batch that changes
    every few steps, as under serving load); every step's decisions and the pool's cache. Prompts
    longer than the 40-token budget are prefilled in chunks, competing with the decodes for it."""
    rng = random.Random(seed)
    d = Driver(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=40, max_num_seqs=10, policy=policy)
    steps: list[tuple] = []
    for t in range(500):
        if t < 150 and rng.random() < 0.3:
            d.add(f"r{d._num_added}", rng.randrange(2, longest_prompt), max_tokens=rng.randrange(3, 30))
        if t >= 150 and not d.sched.has_unfinished():
            break
        out = d.step()
        steps.append(_decisions(d, out))
    d.assert_drained()
    return steps, d


@pytest.mark.parametrize("policy", ["fifo", "fair", "prefill_first"])
@pytest.mark.parametrize(("num_blocks", "longest_prompt"), [(96, 12), (24, 12), (128, 90)])
def test_a_steady_batch_kept_as_requests_come_and_go_decides_as_the_per_request_path(
    monkeypatch, policy, num_blocks, longest_prompt
):
    """Members that end leave the batch, requests past their prefill join it (``follow``,
    ``join``): every step decides as the per-request path does, with the pool running short (24
    blocks: preemptions) or not, and with chunked prefills running behind the batch (prompts up to
    90 tokens); under fifo and fair the batch is kept across arrivals."""
    with monkeypatch.context() as m:
        BulkCounts(m, enabled=False)
        ref_steps, ref = _churn(policy, num_blocks, num_blocks + 1, longest_prompt)
    counts = BulkCounts(monkeypatch, enabled=True)
    steps, got = _churn(policy, num_blocks, num_blocks + 1, longest_prompt)
    for i, (want, have) in enumerate(zip(ref_steps, steps)):
        assert have == want, f"step {i} differs"
    assert len(steps) == len(ref_steps)
    assert got.outputs == ref.outputs and got.finish_reasons == ref.finish_reasons
    assert counts.scheduled >= 25 and counts.dropped >= 3
    if policy != "prefill_first":  # (there the batch is kept only while nothing runs after it)
        assert counts.joined >= 20
    if num_blocks == 24:
        assert ref.sched.num_preemptions > 0


def test_following_the_running_list_drops_ended_members_and_refuses_a_changed_order():
    """``follow``: the members that no longer run leave (their rows, positions and residue lists),
    the requests after the members come back as the tail (unless the policy allows none), and a
    running list whose head is not the members, in order, is refused."""
    reqs = [
        Request(f"m{i}", [1, 2, 3], SamplingParams(max_tokens=9), seed=0, eos_token_ids=frozenset())
        for i in range(5)
    ]
    for r in reqs:
        r.status = RequestStatus.RUNNING
    a, b, c, x, y = reqs

    def batch() -> SteadyDecodes:
        steady = SteadyDecodes.capture([a, b, c], ["m0", "m1", "m2"], [4, 5, 6], 100)
        steady.due = [[a], [b], [c], []]  # as the first advance builds them (block size 4)
        return steady

    steady = batch()
    assert steady.follow([a, b, c], tail_ok=False) == []
    assert steady.follow([a, b, c, x, y], tail_ok=True) == [x, y]
    assert steady.follow([a, b, c, x], tail_ok=False) is None  # prefill_first: nothing behind it
    assert steady.follow([a, c, b], tail_ok=True) is None  # reordered
    b.status = RequestStatus.FINISHED_STOPPED
    assert steady.follow([a, c, x], tail_ok=True) == [x]
    assert (steady.running, steady.ids, steady.positions) == ([a, c], ["m0", "m2"], [4, 6])
    assert steady.due == [[a], [], [c], []]
    b.status = RequestStatus.RUNNING  # ... and back at the end of the list (preempted, resumed)
    steady = batch()
    assert steady.follow([a, c, b], tail_ok=True) is None
    for r in (a, c):
        r.status = RequestStatus.FINISHED_LENGTH
    b.status = RequestStatus.WAITING
    assert steady.follow([x], tail_ok=True) is None  # no member left


def test_blocks_filled_by_steady_decodes_are_cached_for_the_next_request(monkeypatch):
    """A decode that fills a block caches it (``fill_block``): a second request whose prompt is the
    first one's whole output hits every block the first one's steady steps filled."""
    counts = BulkCounts(monkeypatch, enabled=True)
    d = Driver(num_blocks=64, block_size=4)
    first = d.add("a", 5, max_tokens=24)
    d.run()
    assert counts.scheduled >= 10
    d.add("b", list(first.token_ids), max_tokens=2)
    d.step()
    assert d.sched.requests["b"].num_cached_tokens == (len(first.token_ids) - 1) // 4 * 4


def test_a_stop_token_sampled_in_a_steady_batch_ends_its_request_there(monkeypatch):
    """The bulk update checks the batch's tokens against every request's stop tokens: the one that
    samples its own stop token ends with it, the others go on."""
    counts = BulkCounts(monkeypatch, enabled=True)
    d = Driver(num_blocks=64, block_size=4)
    for i in range(4):
        d.add(f"r{i}", 5 + i, max_tokens=30)
    stop = seq_token("s", 5 + 12)  # what "s" samples 13th (the fake runner's token at that position)
    params = SamplingParams(max_tokens=30, stop_token_ids=[stop])
    d.sched.add(
        Request("s", make_prompt("s", 5), params, seed=0, eos_token_ids=frozenset(), arrival_time=9.0)
    )
    d.run()
    assert d.outputs[("s", 0)] == [seq_token("s", p) for p in range(5, 18)]
    assert d.finish_reasons[("s", 0)] == "stop"
    assert all(len(d.outputs[(f"r{i}", 0)]) == 30 for i in range(4))
    assert counts.appended >= 10
    d.assert_drained()


# The engine: scheduler, runner and update together, against the tiny model -----------------------

PROMPTS = [[3 + i, 17, 29, 41, 5, 8, 13, 21, 34, 55, 89, 2, 7][: 3 + (5 * i) % 11] for i in range(7)]


def _params(i: int) -> SamplingParams:
    if i % 3 == 1:  # seeded sampling: the rows' parameters are gathered on the device once
        return SamplingParams(temperature=0.9, top_k=20, seed=i, max_tokens=14 + 3 * i, ignore_eos=True)
    if i == 4:  # one that may stop on a token of its own
        return SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[40, 77, 101])
    return SamplingParams(temperature=0, max_tokens=10 + 4 * i, ignore_eos=True)


def _engine_steps(model, overlap: bool, columns: bool) -> list[list]:
    core = EngineCore(
        EngineConfig(
            model=str(model), block_size=4, num_blocks=128, async_scheduling="on" if overlap else "off"
        )
    )
    free = core.kv.num_free_blocks
    steps = []
    for t in range(300):
        if t in (0, 6, 19):  # arrivals while a steady batch runs
            for i in range(2 if steps else 4):
                n = len(core.scheduler.requests) + t
                core.add_request(f"r{t}-{i}", PROMPTS[n % len(PROMPTS)], _params(n))
        if t > 19 and not core.has_unfinished():
            break
        if columns:
            plain = PlainTokens()
            outs = plain.merged(core.step(plain))
        else:
            outs = core.step()
        steps.append(sorted((o.request_id, o.new_token_ids, o.finish_reason) for o in outs))
    assert not core.has_unfinished()
    assert core.kv.num_free_blocks == free
    return steps


@pytest.mark.parametrize("overlap", [False, True])
def test_steady_engine_steps_equal_the_per_request_steps(monkeypatch, tiny_llama, overlap):
    """The torch attention backend (CPU's), whose decodes run longest first: the runner's batch is
    the running list in another order. (The driver above reports its batch in the running list's
    order, as the Triton backend's runner does.)"""
    with monkeypatch.context() as m:
        BulkCounts(m, enabled=False)
        want = _engine_steps(tiny_llama, overlap, columns=False)
    counts = BulkCounts(monkeypatch, enabled=True)
    assert _engine_steps(tiny_llama, overlap, columns=False) == want
    assert _engine_steps(tiny_llama, overlap, columns=True) == want
    assert counts.scheduled >= 20 and counts.advanced >= 20
    if not overlap:  # overlapped steps' tokens go through the placeholders' path
        assert counts.appended >= 20


def _engine_churn(model, overlap: bool) -> list[list]:
    """Arrivals every few steps, short and long outputs: the batch followed through its changes,
    members reaching their length limits soon after they join."""
    core = EngineCore(
        EngineConfig(
            model=str(model), block_size=4, num_blocks=160, async_scheduling="on" if overlap else "off"
        )
    )
    free = core.kv.num_free_blocks
    steps = []
    schedule = core.scheduler.schedule

    def recorded():  # what each step scheduled, as well as what it produced
        out = schedule()
        steps.append(dict(out.num_scheduled_tokens))
        return out

    core.scheduler.schedule = recorded
    for t in range(400):
        if t < 90 and t % 3 == 0:
            n = t // 3
            params = SamplingParams(temperature=0, max_tokens=(3, 25, 6, 40, 2)[n % 5], ignore_eos=True)
            core.add_request(f"c{t}", PROMPTS[n % len(PROMPTS)], params if n % 7 else _params(n))
        if t >= 90 and not core.has_unfinished():
            break
        steps.append(sorted((o.request_id, o.new_token_ids, o.finish_reason) for o in core.step()))
    assert not core.has_unfinished()
    assert core.kv.num_free_blocks == free
    return steps


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_steps_of_a_changing_batch_equal_the_per_request_steps(monkeypatch, tiny_llama, overlap):
    """The engine with the batch followed as requests come and go, overlapped or not: the same
    tokens scheduled, tokens out and finishes, step by step, as the per-request paths. With
    overlap, a member whose token in flight is its last is held back (it leaves the batch, which
    goes on without it), a member that joined included: scheduling it would be a token more than
    the per-request path schedules."""
    with monkeypatch.context() as m:
        BulkCounts(m, enabled=False)
        want = _engine_churn(tiny_llama, overlap)
    counts = BulkCounts(monkeypatch, enabled=True)
    assert _engine_churn(tiny_llama, overlap) == want
    # As many bulk steps overlapped as not (180 of the run's steps): a held member does not end the batch.
    assert counts.scheduled >= 170 and counts.joined >= 25 and counts.dropped >= 25
