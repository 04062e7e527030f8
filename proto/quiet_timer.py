"""A deadline on each wait for a stream's next message that costs nothing per message.

The router's stall watch and the decode worker's keepalive both bound how long one wait for a
stream's next message may last. ``asyncio.timeout`` around each wait builds a context manager, looks
up the current task and schedules and cancels a timer on the event loop's heap per message: py-spy
put it at 15-20% of the router's samples on short streams. ``QuietTimer`` keeps one timer per stream
and re-arms it only when it fires: a wait stamps its start and clears a flag when done. When the
timer finds a wait older than the limit it cancels the waiting task and the wait raises
``TimeoutError``, as ``asyncio.timeout`` would (an outside cancel is passed on as ``CancelledError``).
The limit is read when the timer fires, so a limit that changes between messages is honoured.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class QuietTimer:
    """Made inside the task that waits; ``wait(aw)`` is ``await aw`` bounded by ``limit()`` seconds."""

    __slots__ = ("_fired", "_handle", "_limit", "_loop", "_since", "_task", "_waiting")

    def __init__(self, limit: Callable[[], float]) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._limit = limit
        self._since = 0.0
        self._waiting = False
        self._fired = False
        self._handle: asyncio.TimerHandle | None = None

    async def wait(self, aw: Awaitable[T]) -> T:
        self._since = self._loop.time()
        self._waiting = True
        if self._handle is None:
            self._handle = self._loop.call_at(self._since + self._limit(), self._check)
        try:
            return await aw
        except asyncio.CancelledError:
            if self._fired:
                self._fired = False
                if self._task.uncancel() == 0:  # ours alone: the wait timed out
                    raise TimeoutError from None
            raise
        finally:
            self._waiting = False

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _check(self) -> None:
        self._handle = None
        if not self._waiting:
            return  # the next wait arms it again
        due = self._since + self._limit()
        if self._loop.time() >= due:
            self._fired = True
            self._task.cancel()
        else:
            self._handle = self._loop.call_at(due, self._check)
