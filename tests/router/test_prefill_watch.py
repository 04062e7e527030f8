"""The prefill call's stall watch alone: a worker silent past its deadline has its call cancelled,
and the deadline scales with the worker's longest recent step (a slow step is no stall)."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from proto import pdserve_pb2 as pb
from registry.schema import WorkerRecord
from router.migration import MigrationOptions
from router.prefill_watch import PrefillStalled, watched

OPTIONS = MigrationOptions(stall_floor_s=5.0, stall_step_multiple=20.0)


class _Call:
    """A Prefill call as the router holds it (``StreamedCall``'s ``answer`` and ``cancel``)."""

    def __init__(self) -> None:
        self.future = asyncio.get_running_loop().create_future()

    async def answer(self):
        # As a StreamedCall: the waiting task's cancel does not end the call; only cancel() does.
        return await asyncio.shield(self.future)

    def cancel(self) -> bool:
        return self.future.cancel()


def _worker(step_ms: int) -> WorkerRecord:
    return WorkerRecord(worker_id="p0", role="prefill", address="-", epoch=1, step_ms=step_ms)


def test_a_silent_worker_past_its_deadline_has_its_call_cancelled():
    async def run() -> None:
        call = _Call()  # never answers
        with pytest.raises(PrefillStalled, match="p0"):
            await watched(call, _worker(0), lambda _: 6.0, OPTIONS, poll_s=0.01)
        assert call.future.cancelled()

    asyncio.run(run())


def test_a_worker_with_slow_steps_gets_a_longer_deadline_and_its_answer_comes_through():
    async def run() -> None:
        call = _Call()
        silent = 0.0

        def silent_for(_: str) -> float:  # the silence rises past the floor, not past 20 x 1 s
            nonlocal silent
            silent += 1.0
            if silent >= 12:
                call.future.set_result(pb.PrefillResponse())
            return silent

        resp = await watched(call, _worker(1000), silent_for, OPTIONS, poll_s=0.01)
        assert isinstance(resp, pb.PrefillResponse) and silent >= 12

    asyncio.run(run())


def test_a_caller_leaving_cancels_the_call_and_is_no_stall():
    async def run() -> None:
        call = _Call()
        started = asyncio.Event()

        async def caller():
            started.set()
            return await watched(call, _worker(0), lambda _: 0.0, OPTIONS, poll_s=0.01)

        task = asyncio.ensure_future(caller())
        await started.wait()
        await asyncio.sleep(0.05)  # a few healthy checks pass first
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert call.future.cancelled()

    asyncio.run(run())


def test_a_long_step_announced_by_the_heartbeats_raises_the_deadline_of_a_call_already_open():
    """The call opens while the worker's record says its steps are short (a cold worker: 0); then
    its heartbeats carry the budget of the long step it has scheduled (``engine.step_budget``), and
    the silence that would pass the 5 s floor is no stall. A worker whose budget stays short is one."""

    async def run(announced_s: float) -> tuple[bool, float]:
        call = _Call()
        silent = 0.0

        def silent_for(_: str) -> float:
            nonlocal silent
            silent += 0.5
            if silent >= 8:
                call.future.set_result(pb.PrefillResponse())
            return silent

        try:
            await watched(call, _worker(0), silent_for, OPTIONS, poll_s=0.01, step_s_of=lambda _: announced_s)
            return True, silent
        except PrefillStalled:
            return False, silent

    assert asyncio.run(run(10.24)) == (True, 8.0)  # 2,048 tokens at the cold 5 ms a token
    assert asyncio.run(run(0.0)) == (False, 5.5)


def test_an_answered_watch_leaves_nothing_for_the_cyclic_collector():
    """The watch's timer callback refers to itself and to the request's task: left as a cycle, every
    request's task and frames waited for a collection (17-22% of the ingress's CPU at 16/16 tokens,
    bench/README "The collector"). Answered after a few checks, the task is freed as it ends."""

    async def run() -> bool:
        call, checks = _Call(), 0

        def silent_for(_: str) -> float:
            nonlocal checks
            checks += 1
            if checks == 3:
                call.future.set_result(pb.PrefillResponse())
            return 0.0

        task = asyncio.ensure_future(watched(call, _worker(0), silent_for, OPTIONS, poll_s=0.001))
        await task
        ref = weakref.ref(task)
        del task
        await asyncio.sleep(0)  # the loop lets go of the handle that woke this task
        return ref() is None

    gc.collect()
    gc.disable()
    try:
        assert asyncio.run(run())
    finally:
        gc.enable()
