"""How long an engine step may take before a watcher calls its engine stalled.

The router judges a worker stalled when its engine has made no progress for ``stall_step_multiple``
times its *step budget* (``router.migration.MigrationOptions.deadline_s``, never under a floor of a
few seconds). The budget used to be the longest recent step alone, so a step much longer than the
recent ones was taken for a hang: a cold worker's first 2,048-token prefill on a CPU ran past the
5 s floor, and so did a long prompt after a stretch of short decode steps (the 503 of a valid
request, and the next one's, as a user saw it). A step's length follows its tokens, and the engine
knows them once it has scheduled: the budget is now the longest of the recent steps (decaying) and
what the running step's tokens cost at the highest recent cost per token of a large step, or, before
any large step, at ``COLD_TOKEN_S`` (generous for any GPU and for small models on a CPU; the
multiple on top covers 20 times that). A hung step is still caught: its budget is fixed when it
starts and never grows while it runs.
"""

from __future__ import annotations

from collections.abc import Callable

DECAY = 0.99  # per step: a long step is remembered for a few hundred short ones
COLD_TOKEN_S = 0.005  # per token, before the engine has timed a large step
LARGE_STEP_TOKENS = 256  # steps this large time the cost per token (smaller ones are overhead)


class StepBudget:
    """The engine loop's record of its steps: ``started(tokens)`` once a step is scheduled (the
    engine calls it), ``finished(seconds)`` after it; ``budget_s`` is what a watcher judges a stall
    against."""

    __slots__ = ("expected_s", "on_start", "recent_s", "token_s", "tokens")

    def __init__(self, on_start: Callable[[], None] | None = None) -> None:
        self.on_start = on_start  # told once a step's budget is known (an engine process's clock)
        self.recent_s = 0.0  # the longest recent step, decaying
        self.token_s = 0.0  # the highest recent cost per token of a large step, decaying; 0: none yet
        self.expected_s = 0.0  # what the running step's tokens cost at that rate; 0 between steps
        self.tokens = 0  # the running (or last) step's

    @property
    def budget_s(self) -> float:
        return max(self.recent_s, self.expected_s)

    def started(self, tokens: int) -> None:
        self.tokens = tokens
        self.expected_s = tokens * (self.token_s or COLD_TOKEN_S)
        if self.on_start is not None:
            self.on_start()

    def finished(self, seconds: float) -> None:
        self.recent_s = max(seconds, self.recent_s * DECAY)
        if self.tokens >= LARGE_STEP_TOKENS:
            self.token_s = max(seconds / self.tokens, self.token_s * DECAY)
        self.expected_s = 0.0
