"""A runner that executes no model: it follows the scheduler's protocol and samples fixed tokens.

Drives the scheduler without a model, for the scheduler's unit tests (tests/engine) and the
scheduler-overhead benchmark (bench/scheduler_overhead.py).
"""

from __future__ import annotations

from collections.abc import Callable

from engine.scheduler_output import RunnerOutput, SchedulerOutput

TokenFn = Callable[[str, int], int]


def constant_token(seq_id: str, position: int) -> int:
    return 7


class FakeRunner:
    """Stands in for ``ModelRunner``: follows the scheduler's deltas and samples where it would.

    Like ``ModelRunner._prepare``, a sequence samples when its scheduled tokens reach the end of its
    known tokens (``num_computed_tokens + scheduled == len(tokens)``); it then draws
    ``num_samples`` tokens (n > 1 forks) and keeps the first, as the real runner does. The sampled
    token is ``token_fn(seq_id, position)``, 7 by default. A step that breaks the scheduler/runner
    protocol (a delta for a sequence the runner does not know, tokens scheduled past the known ones)
    raises ``RuntimeError``.
    """

    def __init__(self, token_fn: TokenFn = constant_token) -> None:
        self.token_fn = token_fn
        self.num_tokens: dict[str, int] = {}
        self._repeat: list[str] | None = None  # the last step's fast-path decodes (ModelRunner's RepeatCache)

    def __call__(self, sched: SchedulerOutput) -> RunnerOutput:
        num_tokens = self.num_tokens
        if sched.finished_seq_ids or sched.new_seqs:
            self._repeat = None
        for seq_id in sched.finished_seq_ids:
            num_tokens.pop(seq_id, None)
        for new in sched.new_seqs:
            num_tokens[new.seq_id] = len(new.token_ids)
        for run in sched.running_seqs:
            if run.seq_id not in num_tokens:
                raise RuntimeError(f"running delta for {run.seq_id!r}, which the runner never received")
        out = RunnerOutput()
        for seq_id in sched.decode_ids:
            if seq_id not in num_tokens:
                raise RuntimeError(f"fast-path decode of {seq_id!r}, which the runner never received")
        for seq_id, computed, num_samples in sched.spans():
            end = computed + sched.num_scheduled_tokens[seq_id]
            known = num_tokens[seq_id]
            if end > known:
                raise RuntimeError(f"{seq_id!r} scheduled up to token {end} but has only {known}")
            if end == known:
                out.sampled[seq_id] = [self.token_fn(seq_id, known)] * num_samples
                num_tokens[seq_id] = known + 1
        return self._as_repeat(sched, out)

    def _as_repeat(self, sched: SchedulerOutput, out: RunnerOutput) -> RunnerOutput:
        """As ``ModelRunner.collect`` reports a steady decode batch: a step of the last step's
        fast-path decodes alone, each sampled once, as columns (``repeat_ids`` is one list object
        while the batch repeats)."""
        ids = sched.decode_ids
        steady = len(ids) == len(sched.num_scheduled_tokens) == len(out.sampled) and all(
            len(out.sampled.get(s, ())) == 1 for s in ids
        )
        if not steady or ids != self._repeat:
            self._repeat = list(ids) if steady else None
            return out
        out.repeat_ids, out.repeat_tokens = self._repeat, [out.sampled[s][0] for s in ids]
        out.sampled = {}
        return out
