"""Per-request hop timing on a worker: how long a request queued, and the step that produced its
first token.

A request's stamps, all ``time.monotonic()`` (the engine loop's clock): ``arrive`` when its handler
takes it (event-loop thread) -> ``ready`` when the engine could first run it: added to the engine,
or its KV landed (engine thread) -> its first output (engine thread, an output hook): the step that
produced it started at ``max(the loop's stamp of that step's start, ready)``. ``kv_transfer_s`` is set by the
decode worker's pull. The handler reads the stamps after it received the first output (the output's
delivery orders the writes before the reads) and ``forget``s the request when it ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.engine_loop import EngineLoop
from engine.scheduler_output import SequenceOutput


@dataclass(slots=True)
class RequestClock:
    arrived: float
    ready: float = 0.0
    step_started: float | None = None
    first_output: float | None = None
    kv_transfer_s: float | None = None

    @property
    def queue_s(self) -> float:
        """Arrival -> start of the step that produced the first output, less the KV transfer."""
        if self.step_started is None:
            return 0.0
        return max(0.0, self.step_started - self.arrived - (self.kv_transfer_s or 0.0))

    @property
    def first_step_s(self) -> float:
        if self.step_started is None or self.first_output is None:
            return 0.0
        return max(0.0, self.first_output - self.step_started)


class RequestClocks:
    """The clocks of the requests a worker is serving."""

    def __init__(self, loop: EngineLoop) -> None:
        self._loop = loop
        self._clocks: dict[str, RequestClock] = {}
        loop.add_output_hook(self._on_output)

    def arrive(self, request_id: str) -> RequestClock:
        clock = self._clocks[request_id] = RequestClock(time.monotonic())
        return clock

    def ready(self, request_id: str) -> None:
        """Engine thread: the request can run from the next step on."""
        clock = self._clocks.get(request_id)
        if clock is not None:
            clock.ready = time.monotonic()

    def transferred(self, request_id: str, seconds: float, at: float | None = None) -> None:
        """The request's KV landed after a READ of ``seconds``: now (the engine thread), or ``at``
        (``time.monotonic()`` where it landed: an engine process's report, read later)."""
        clock = self._clocks.get(request_id)
        if clock is not None:
            clock.kv_transfer_s = seconds
            clock.ready = time.monotonic() if at is None else at

    def get(self, request_id: str) -> RequestClock | None:
        return self._clocks.get(request_id)

    def forget(self, request_id: str) -> None:
        self._clocks.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._clocks)

    def _on_output(self, out: SequenceOutput) -> None:
        clock = self._clocks.get(out.request_id)
        if clock is None or clock.first_output is not None or not out.new_token_ids:
            return
        clock.first_output = time.monotonic()
        # Called from publish(core.step()): the loop's step_started is this step's start (loop
        # ticks and other requests' commands between steps are not counted as the step).
        clock.step_started = max(self._loop.step_started, clock.ready or clock.arrived)
