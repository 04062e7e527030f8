"""``QuietTimer``: a bounded wait for a stream's next message, its one timer re-armed only when it
fires. A wait past the limit raises TimeoutError; time spent not waiting does not count; the limit
is read when the timer fires; an outside cancel stays a cancel."""

from __future__ import annotations

import asyncio

import pytest

from proto.quiet_timer import QuietTimer


def test_waits_return_their_results_and_one_timer_serves_them_all():
    async def run():
        loop = asyncio.get_running_loop()
        quiet = QuietTimer(lambda: 60.0)
        results = []
        for i in range(100):
            fut = loop.create_future()
            loop.call_soon(fut.set_result, i)
            results.append(await quiet.wait(fut))
        handle = quiet._handle
        assert handle is not None and not handle.cancelled()  # the first wait's timer, still armed
        quiet.close()
        assert handle.cancelled()
        return results

    assert asyncio.run(run()) == list(range(100))


def test_a_wait_longer_than_the_limit_raises_timeout_error():
    async def run():
        quiet = QuietTimer(lambda: 0.02)
        with pytest.raises(TimeoutError):
            await quiet.wait(asyncio.get_running_loop().create_future())  # never completes
        fut = asyncio.get_running_loop().create_future()
        fut.set_result("next")
        return await quiet.wait(fut)  # the stream goes on after a timeout (a keepalive's case)

    assert asyncio.run(run()) == "next"


def test_time_not_waiting_does_not_count():
    async def run():
        loop = asyncio.get_running_loop()
        quiet = QuietTimer(lambda: 0.05)
        done = loop.create_future()
        done.set_result(1)
        await quiet.wait(done)
        await asyncio.sleep(0.2)  # busy elsewhere (the consumer): four limits pass, no wait open
        fut = loop.create_future()
        loop.call_soon(fut.set_result, 2)
        return await quiet.wait(fut)

    assert asyncio.run(run()) == 2


def test_the_limit_is_read_when_the_timer_fires():
    async def run():
        loop = asyncio.get_running_loop()
        limit = [0.02]
        quiet = QuietTimer(lambda: limit[0])
        fut = loop.create_future()
        # Raised once the wait armed its timer for 0.02 s (a worker whose steps got slower).
        loop.call_soon(limit.__setitem__, 0, 60.0)
        loop.call_later(0.1, fut.set_result, "late")
        return await quiet.wait(fut)

    assert asyncio.run(run()) == "late"


def test_an_outside_cancel_is_a_cancel_not_a_timeout():
    async def run():
        loop = asyncio.get_running_loop()
        started = asyncio.Event()

        async def waiter():
            quiet = QuietTimer(lambda: 60.0)
            started.set()
            await quiet.wait(loop.create_future())

        task = asyncio.ensure_future(waiter())
        await started.wait()
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
