"""The runner's repeat cache (``engine.step_batch.RepeatCache``): a steady decode batch's columns
are kept between steps, and a step whose fast-path decodes repeat the last ones reuses them. These
tests drive ``ModelRunner.launch`` with scheduler outputs built by hand, so the cases the scheduler
makes rarely (a sequence resumed in a step without fast-path decodes) are certain; each compares
the sampled tokens with the same steps taken without the fast path (no cache at all)."""

from __future__ import annotations

from engine import EngineConfig, EngineCore, SamplingParams
from engine.scheduler_output import NewSequenceData, RunningSequenceData, SchedulerOutput

PROMPTS = {"a": [3, 17, 29, 41, 5, 8, 13, 21, 34, 55, 89, 2, 7], "b": [11, 12, 99, 4, 6, 60, 70]}
BLOCKS = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]}


def _runner(model):
    core = EngineCore(
        EngineConfig(model=str(model), device="cpu", dtype="float32", block_size=16, num_blocks=32)
    )
    return core.runner


def _new(seq_id: str, tokens: list[int], blocks: list[int]) -> NewSequenceData:
    return NewSequenceData(seq_id, list(tokens), list(blocks), 0, SamplingParams(temperature=0), 0, 0)


def _prefill(seqs: list[NewSequenceData], finished=()) -> SchedulerOutput:
    out = SchedulerOutput(new_seqs=seqs, finished_seq_ids=set(finished))
    out.num_scheduled_tokens = {d.seq_id: len(d.token_ids) for d in seqs}
    out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
    return out


def _decode(lengths: dict[str, int], fast: bool) -> SchedulerOutput:
    """One token for each sequence whose known tokens number ``lengths[seq]``: on the fast path
    (``decode_ids``) or as running-sequence deltas (which never touch the cache)."""
    out = SchedulerOutput(
        num_scheduled_tokens=dict.fromkeys(lengths, 1), total_num_scheduled_tokens=len(lengths)
    )
    for seq_id, n in lengths.items():
        if fast:
            out.decode_ids.append(seq_id)
            out.decode_positions.append(n - 1)
        else:
            out.running_seqs.append(RunningSequenceData(seq_id, [], None, n - 1))
    return out


def _run(model, fast: bool, overlap: bool) -> dict[str, list[int]]:
    """Prefill a and b, decode both twice, resume a (recomputed from its tokens, new blocks) in a
    step without b, then decode both three times: every token each sequence sampled."""
    runner = _runner(model)
    got: dict[str, list[int]] = {"a": [], "b": []}
    known = {s: list(p) for s, p in PROMPTS.items()}
    pending = []

    def record(launch) -> None:
        done = runner.collect(launch)
        sampled = dict(zip(done.repeat_ids or (), ([t] for t in done.repeat_tokens or ())))
        for seq_id, toks in {**done.sampled, **sampled}.items():
            got[seq_id].append(toks[0])
            if launch.slots:  # overlapped: the token stood in as a placeholder meanwhile
                known[seq_id][known[seq_id].index(-1)] = toks[0]
            else:
                known[seq_id].append(toks[0])

    def step(sched: SchedulerOutput) -> None:
        launch = runner.launch(sched, overlap=overlap)
        if pending:  # overlapped: the step before is collected after this one launched
            record(pending.pop())
        if launch.slots:
            pending.append(launch)
            for seq_id in launch.slots:  # the next step decodes this token before its value is in
                known[seq_id].append(-1)
        else:
            record(launch)

    def settle() -> None:
        if pending:
            record(pending.pop())

    step(_prefill([_new(s, PROMPTS[s], BLOCKS[s]) for s in ("a", "b")]))
    for _ in range(2):
        step(_decode({s: len(known[s]) for s in ("a", "b")}, fast))
    settle()
    # a is preempted and recomputed: its state (token list, table row) is new; b sits this step out.
    step(_prefill([_new("a", known["a"], [9, 10, 11, 12])]))
    settle()
    for _ in range(3):
        step(_decode({s: len(known[s]) for s in ("a", "b")}, fast))
    settle()
    return got


def test_a_resumed_sequence_never_decodes_from_its_old_state(tiny_llama):
    """The fast-path ids after the resume equal those cached before it; the cache must not hand
    the step the old token list or table row of the resumed sequence."""
    for overlap in (False, True):
        reference = _run(tiny_llama, fast=False, overlap=overlap)
        assert len(reference["a"]) == 7 and len(reference["b"]) == 6
        assert _run(tiny_llama, fast=True, overlap=overlap) == reference, f"overlap={overlap}"
