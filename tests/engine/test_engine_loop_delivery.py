"""How the engine thread hands outputs to the event loops that stream them: a step's outputs wake
each reading loop once (one callback for all its streams, not one per sequence), in order, and a
loop that closed meanwhile costs the engine thread nothing."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.engine_loop import EngineLoop
from engine.scheduler_output import SequenceOutput


def _out(rid: str, token: int, finish: str | None = None) -> SequenceOutput:
    return SequenceOutput(rid, 0, [token], finish_reason=finish)


def _count_wakeups(loop: asyncio.AbstractEventLoop) -> list[int]:
    """``[n]``: the times another thread woke ``loop`` (``call_soon_threadsafe``) from now on."""
    count = [0]
    real = loop.call_soon_threadsafe

    def counting(*args):
        count[0] += 1
        return real(*args)

    loop.call_soon_threadsafe = counting
    return count


def test_a_steps_outputs_wake_each_loop_once_and_arrive_in_order():
    engine_loop = EngineLoop(core=None)
    hooked: list[str] = []
    engine_loop.add_output_hook(lambda out: hooked.append(out.request_id))

    async def run():
        wakeups = _count_wakeups(asyncio.get_running_loop())
        queues = {rid: engine_loop.open_stream(rid) for rid in ("a", "b", "c")}
        step = [_out("a", 1), _out("b", 2), _out("a", 3), _out("gone", 4), _out("c", 5, "length")]
        # From another thread, as the engine thread publishes.
        engine_thread = threading.Thread(target=engine_loop.publish, args=(step,))
        engine_thread.start()
        got = {rid: [] for rid in queues}
        for rid, q in queues.items():
            while len(got[rid]) < {"a": 2, "b": 1, "c": 1}[rid]:
                got[rid].append((await q.get()).new_token_ids[0])
        engine_thread.join()
        assert wakeups[0] == 1
        assert got == {"a": [1, 3], "b": [2], "c": [5]}
        assert all(q.empty() for q in queues.values())

    asyncio.run(run())
    assert hooked == ["a", "b", "a", "gone", "c"]  # every output passes the hooks, streamed or not


def test_outputs_for_a_closed_loop_are_dropped_without_failing_the_engine_thread():
    engine_loop = EngineLoop(core=None)
    loop = asyncio.new_event_loop()
    opened = threading.Event()

    async def open_one():
        engine_loop.open_stream("r")
        opened.set()

    loop.run_until_complete(open_one())
    loop.close()
    assert opened.is_set()
    engine_loop.publish([_out("r", 1)])  # raised RuntimeError("Event loop is closed") before
    assert engine_loop.failure is None


class _IdleCore:
    """An engine with nothing to step: the loop only runs commands (the logic under test)."""

    def has_work(self) -> bool:
        return False


def test_awaited_commands_reply_together_and_a_cancelled_wait_does_not_run():
    engine_loop = EngineLoop(core=_IdleCore(), idle_tick_s=0.001)
    ran: list[str] = []

    def command(name: str):
        def fn():
            ran.append(name)
            if name == "bad":
                raise ValueError("refused")
            return (name, threading.get_ident())

        return fn

    async def run():
        wakeups = _count_wakeups(asyncio.get_running_loop())
        waits = {
            n: asyncio.ensure_future(engine_loop.run(command(n))) for n in ("a", "b", "bad", "gone", "c")
        }
        await asyncio.sleep(0)  # every command queued before the engine thread runs any
        waits["gone"].cancel()
        await asyncio.sleep(0)
        engine_loop.start()
        results = {n: (await w) for n, w in waits.items() if n not in ("bad", "gone")}
        with pytest.raises(ValueError, match="refused"):
            await waits["bad"]
        assert waits["gone"].cancelled()
        assert wakeups[0] == 1  # the four replies reached this loop in one callback
        assert {n: r[0] for n, r in results.items()} == {"a": "a", "b": "b", "c": "c"}
        assert {r[1] for r in results.values()} == {engine_loop._thread.ident}  # on the engine thread
        assert ran == ["a", "b", "bad", "c"]  # the cancelled wait's command never ran

    try:
        asyncio.run(run())
    finally:
        engine_loop.stop()
