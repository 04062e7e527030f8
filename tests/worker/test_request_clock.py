"""A worker's per-request clock: the stamps its hop timing is made of are consistent — the queue,
the KV transfer and the first step add up to arrival -> first output, the step starts no earlier
than the request could run, and a request's clock is gone once it is forgotten."""

from __future__ import annotations

import time

from engine.scheduler_output import SequenceOutput
from worker.request_clock import RequestClocks


class FakeLoop:
    def __init__(self) -> None:
        self.hooks = []
        self.step_started = 0.0

    def add_output_hook(self, fn) -> None:
        self.hooks.append(fn)

    def output(self, out: SequenceOutput) -> None:
        for hook in self.hooks:
            hook(out)


def test_first_output_splits_into_queue_transfer_and_step():
    loop = FakeLoop()
    clocks = RequestClocks(loop)
    clock = clocks.arrive("r")
    clocks.transferred("r", 0.0)  # the KV landed (a READ of no measurable length)
    loop.step_started = time.monotonic()  # the step that served it started after it was ready
    loop.output(SequenceOutput("other", 0, [5]))  # another request's output leaves "r" alone
    assert clock.first_output is None
    loop.output(SequenceOutput("r", 0, []))  # no token yet (e.g. an abort notice): not the first
    assert clock.first_output is None
    loop.output(SequenceOutput("r", 0, [7]))
    first, started = clock.first_output, clock.step_started
    assert started >= clock.ready >= clock.arrived and first >= started
    assert clock.queue_s >= 0 and clock.first_step_s >= 0
    total = clock.queue_s + clock.kv_transfer_s + clock.first_step_s
    assert abs(total - (first - clock.arrived)) < 1e-9
    loop.output(SequenceOutput("r", 0, [8]))  # later tokens do not move the first stamps
    assert (clock.first_output, clock.step_started) == (first, started)
    clocks.forget("r")
    assert clocks.get("r") is None and len(clocks) == 0


def test_step_start_is_the_start_of_the_step_that_served_it():
    loop = FakeLoop()
    clocks = RequestClocks(loop)
    clock = clocks.arrive("r")
    clocks.ready("r")
    loop.step_started = clock.ready + 5.0  # it waited behind a (long) step: its own began later
    loop.output(SequenceOutput("r", 0, [1]))
    assert clock.step_started == loop.step_started
    assert clock.kv_transfer_s is None  # never transferred: aggregated


def test_a_landing_reported_later_counts_from_when_it_landed():
    """An engine process reports a landed KV with the outputs of the step that took the request in:
    the clock keeps the engine's landing time (``at``), so that step is the request's first step and
    not part of its queue (read at its report, the queue swallowed the step and the first step
    measured ~0)."""
    loop = FakeLoop()
    clocks = RequestClocks(loop)
    clock = clocks.arrive("r")
    clock.arrived -= 0.050  # it arrived 50 ms ago
    landed = clock.arrived + 0.010
    loop.step_started = landed + 0.001  # the step right after the landing
    clocks.transferred("r", 0.002, at=landed)  # read now, with that step's outputs
    assert clock.ready == landed
    loop.output(SequenceOutput("r", 0, [7]))
    assert clock.step_started == loop.step_started
    assert abs(clock.queue_s - 0.009) < 1e-9  # arrival -> the step, less the READ
    assert clock.first_step_s == clock.first_output - loop.step_started > 0
