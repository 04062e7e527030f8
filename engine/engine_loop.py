"""The engine's serving loop: ``EngineCore.step()`` in a dedicated thread, asyncio on the outside.

Lifecycle: ``start()`` spawns the thread; it runs queued commands (add, abort, release, ...), then one
engine step if anything is unfinished, then the registered tick callbacks (lease expiry, transfer
polling); when there is nothing to do it sleeps on the command queue until a command arrives or
``idle_tick_s`` passes. ``stop()`` ends it. Per-request outputs go to asyncio queues on the caller's
event loop through ``call_soon_threadsafe``, so a slow stream never stalls a step and a step never
blocks a handler. ``last_progress`` lets a health check tell a stuck loop from an idle one;
``blocked_for()`` and ``recent_step_s`` let a stream's reader (the router) tell a stalled loop from a
busy one.

If ``step()`` itself raises (the engine's state can no longer be trusted), the loop *fails*: every
open stream gets an error output at once (no stream waits for a health check), commands still queued
and any later ``call`` fail with ``EngineLoopFailed``, the ``on_failure`` callbacks run (a worker
leaves the registry) and the thread ends, so ``alive`` turns False.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from engine.engine_core import EngineCore
from engine.scheduler_output import SequenceOutput
from engine.step_budget import StepBudget

logger = logging.getLogger(__name__)
T = TypeVar("T")


def _deliver(items: list[tuple[asyncio.Queue, SequenceOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)


class _Reply:
    """Where an awaited command's (``EngineLoop.run``) result goes: a future of the caller's loop."""

    __slots__ = ("future", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
        self.loop, self.future = loop, future


def _resolve(items: list[tuple[asyncio.Future, bool, Any]]) -> None:
    for future, ok, value in items:
        if future.cancelled():
            continue
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)


def _send_replies(replies: dict[asyncio.AbstractEventLoop, list]) -> None:
    for loop, items in replies.items():
        try:
            loop.call_soon_threadsafe(_resolve, items)
        except RuntimeError:  # that loop closed: nobody waits for these
            logger.debug("dropped %d replies for a closed event loop", len(items))


class EngineLoopFailed(RuntimeError):
    """The engine loop died (its step raised); nothing more will run on it."""


class EngineLoop:
    def __init__(self, core: EngineCore, *, idle_tick_s: float = 0.005) -> None:
        self.core = core
        self.idle_tick_s = idle_tick_s
        self._commands: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future | _Reply]] = (
            queue.Queue()
        )
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ticks: list[Callable[[], None]] = []
        self._hurry: list[Callable[[], bool]] = []
        self._output_hooks: list[Callable[[SequenceOutput], None]] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.last_progress = time.monotonic()
        self.step_started = self.last_progress  # the current (or last) step's start
        self.busy_since: float | None = None
        self.beat = self.last_progress  # the thread's last sign of life: an iteration or a step ended
        self.steps = StepBudget()  # what a stall is judged against; the engine tells it each step's tokens
        if core is not None:
            core.step_budget = self.steps
        self.failure: EngineLoopFailed | None = None
        self._failure_hooks: list[Callable[[EngineLoopFailed], None]] = []

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put((lambda: None, concurrent.futures.Future()))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """The engine thread is running (False before start, and once it failed or stopped)."""
        return self.failure is None and self._thread is not None and self._thread.is_alive()

    def add_tick(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the engine thread after every step and at least every ``idle_tick_s``."""
        self._ticks.append(fn)

    def add_hurry(self, fn: Callable[[], bool]) -> None:
        """While ``fn()`` is True the loop runs its ticks without waiting ``idle_tick_s`` between
        them (a KV read about to land is seen at once, not up to a tick later)."""
        self._hurry.append(fn)

    def add_output_hook(self, fn: Callable[[SequenceOutput], None]) -> None:
        """Run ``fn`` on the engine thread for every output, before it is delivered."""
        self._output_hooks.append(fn)

    def on_failure(self, fn: Callable[[EngineLoopFailed], None]) -> None:
        """Run ``fn`` (on the dying engine thread) if the loop fails; keep it short."""
        self._failure_hooks.append(fn)

    def blocked_for(self) -> float:
        """Seconds since the engine thread last finished a loop iteration or a step: near 0 while it
        runs (idle iterations end every ``idle_tick_s``), the step's age during a long step, growing
        without bound when the thread is stuck or dead."""
        return time.monotonic() - self.beat

    @property
    def recent_step_s(self) -> float:
        """The step budget a stall is judged against: the longest recent step, or what the running
        step's tokens should take if longer (``engine.step_budget``)."""
        return self.steps.budget_s

    def stream_ids(self) -> list[str]:
        """The requests whose outputs someone is waiting for (any thread)."""
        return list(self._streams)

    def has_stream(self, request_id: str) -> bool:
        return request_id in self._streams

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the engine thread (the only thread that touches the engine)."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self.failure is not None:
            fut.set_exception(self.failure)
            return fut
        self._commands.put((fn, fut))
        if self.failure is not None:  # failed meanwhile: its drain may have missed this command
            self._fail_commands()
        return fut

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the engine thread, awaited. The results of every command the thread ran
        together reach each event loop in one callback (``asyncio.wrap_future`` of ``call`` cost each
        command its own self-pipe write and wake-up: 13% of a prefill worker's loop on short
        requests). A cancelled wait that the thread has not reached yet does not run ``fn``."""
        if self.failure is not None:
            raise self.failure
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put((fn, _Reply(loop, future)))
        if self.failure is not None:  # failed meanwhile: its drain may have missed this command
            self._fail_commands()
        return await future

    def open_stream(self, request_id: str) -> asyncio.Queue:
        """Outputs of ``request_id`` arrive on the returned queue (of the calling event loop)."""
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def stuck_for(self) -> float:
        """Seconds the loop has had work without finishing a step (0 when idle or progressing)."""
        return 0.0 if self.busy_since is None else time.monotonic() - max(self.busy_since, self.last_progress)

    def publish(self, outputs: list[SequenceOutput]) -> None:
        """Deliver outputs (a step's, or ones produced outside ``step()``: aborts, stop strings) to
        their streams: one wake-up of each event loop per call, not one per output, so a step of 32
        sequences costs its reader's loop one callback and the engine thread one self-pipe write."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, SequenceOutput]]] = {}
        for out in outputs:
            for hook in self._output_hooks:
                hook(out)
            target = self._streams.get(out.request_id)
            if target is not None:
                loop, q = target
                batches.setdefault(loop, []).append((q, out))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that loop closed: nobody reads these streams any more
                logger.debug("dropped %d outputs for a closed event loop", len(items))

    def _run(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # the engine's state is no longer trustworthy: fail, loudly and at once
            logger.exception("engine loop failed; failing its %d open streams", len(self._streams))
            self._fail(EngineLoopFailed(f"engine step failed: {type(exc).__name__}: {exc}"))

    def _serve(self) -> None:
        core = self.core
        while not self._stop.is_set():
            self.beat = time.monotonic()
            hurry = core.has_work() or any(h() for h in self._hurry)
            try:
                fn, fut = self._commands.get(timeout=0 if hurry else self.idle_tick_s)
            except queue.Empty:
                fn = None
            replies: dict[asyncio.AbstractEventLoop, list] = {}
            while fn is not None:
                self._execute(fn, fut, replies)
                try:
                    fn, fut = self._commands.get_nowait()
                except queue.Empty:
                    fn = None
            if replies:
                _send_replies(replies)
            if core.has_work():
                self.busy_since = self.busy_since or time.monotonic()
                self.step_started = self.beat = time.monotonic()  # what a request's first step is timed from
                self.publish(core.step())
                self.last_progress = self.beat = time.monotonic()
                self.steps.finished(self.last_progress - self.step_started)
            else:
                self.busy_since = None
            for tick in self._ticks:
                try:
                    tick()
                except Exception:
                    logger.exception("engine loop tick failed")

    def _fail(self, failure: EngineLoopFailed) -> None:
        self.failure = failure
        self._fail_commands()
        self.publish(
            [SequenceOutput(rid, 0, [], finish_reason="error", error=str(failure)) for rid in self._streams]
        )
        for hook in self._failure_hooks:
            try:
                hook(failure)
            except Exception:
                logger.exception("engine loop failure hook failed")

    def _fail_commands(self) -> None:
        replies: dict[asyncio.AbstractEventLoop, list] = {}
        while True:
            try:
                _fn, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(fut, _Reply):
                replies.setdefault(fut.loop, []).append((fut.future, False, self.failure))
            elif fut.set_running_or_notify_cancel():
                fut.set_exception(self.failure)
        _send_replies(replies)

    @staticmethod
    def _execute(fn: Callable[[], Any], fut, replies: dict) -> None:
        if isinstance(fut, _Reply):
            if fut.future.cancelled():  # its caller stopped waiting before it ran
                return
            try:
                item = (fut.future, True, fn())
            except BaseException as exc:  # handed to the awaiting caller
                item = (fut.future, False, exc)
            replies.setdefault(fut.loop, []).append(item)
            return
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as exc:  # handed to the awaiting caller
            fut.set_exception(exc)
