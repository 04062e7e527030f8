"""The prefill call's stall watch.

A Prefill call has one answer: nothing comes back until the prompt is done, so, unlike a decode
stream, it cannot carry keepalives. The registry can: every worker heartbeats about once a second, with how
long ago its engine thread last reported its load. While a prefill call is open the router looks
at the worker through its cluster view; when the worker has shown no sign of life for longer than
the stall deadline (its heartbeats stopped rising: a stopped or cut-off process; or its engine
stopped reporting: a hung engine thread), the call is cancelled and ``PrefillStalled`` raised, and
the router retries the prefill elsewhere and keeps the worker out of routing for a while. A worker
that is merely busy (a long prompt, a queue) keeps heartbeating and reporting between its steps, and
the deadline scales with its step budget (heartbeats carry it: engine.step_budget), so a slow step is no stall.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from proto import pdserve_pb2 as pb
from registry.schema import WorkerRecord
from router.migration import MigrationOptions


class PrefillStalled(Exception):
    def __init__(self, worker_id: str, silent_s: float) -> None:
        super().__init__(f"prefill worker {worker_id} stalled: no sign of life for {silent_s:.1f}s")
        self.worker_id = worker_id


async def watched(
    call,
    worker: WorkerRecord,
    silent_for: Callable[[str], float],
    options: MigrationOptions,
    poll_s: float = 0.25,
    step_s_of: Callable[[str], float] | None = None,
) -> pb.PrefillResponse:
    """The answer of ``call`` (a Prefill call to ``worker`` on its call stream, a
    ``proto.call_stream.StreamedCall``), unless ``silent_for(worker id)`` passes the worker's stall
    deadline first: then the call is cancelled and ``PrefillStalled`` raised. The deadline follows
    the worker's step budget as its heartbeats carry it (``step_s_of``): a step scheduled with many
    tokens raises it while it runs (``engine.step_budget``)."""
    step_s = worker.step_ms / 1e3
    # One timer that re-arms itself every ``poll_s`` and cancels the waiting task on a stall: no task
    # or ``asyncio.wait`` per call (most prefills answer before the first check).
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    stalled: list[float] = []

    def check() -> None:
        nonlocal handle, step_s
        if step_s_of is not None:
            step_s = max(step_s, step_s_of(worker.worker_id))
        silent = silent_for(worker.worker_id)
        if silent > options.deadline_s(step_s):
            stalled.append(silent)
            task.cancel()
        else:
            handle = loop.call_later(poll_s, check)

    handle = loop.call_later(poll_s, check)
    answered = False
    try:
        resp = await call.answer()
        answered = True
        return resp
    except asyncio.CancelledError:
        if stalled and task.uncancel() == 0:
            raise PrefillStalled(worker.worker_id, stalled[0]) from None
        raise
    finally:
        handle.cancel()
        # NOTE: ``check``'s cells hold itself, its timer and this task: a cycle that would keep the
        # request's task and frames until a collection. Broken here, reference counting frees them.
        handle = check = None
        if not answered:
            call.cancel()
