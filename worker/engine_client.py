"""A worker's side of an engine in its own process: ``EngineProcess`` spawns ``worker.engine_process``
and offers what a worker uses of an ``EngineLoop`` (streams, failure, the stall clock), with the
engine's operations as commands over the pipe instead of closures on the engine thread.

Construction spawns the process and blocks until its engine is built (the model loaded, the KV pool
allocated: what a worker's constructor does in-process), raising the engine's own error if it cannot
start. ``start()`` (on the worker's event loop) attaches the event pipe to that loop: every
``EngineEvents`` message is read there, its replies settle the awaiting commands and its outputs go
to their streams' queues. The engine process's end of file, or a ``failure`` it reports, fails the
loop as ``EngineLoop`` fails: every open stream gets an error output at once, pending and later
commands raise ``EngineLoopFailed``, the failure callbacks run.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import logging
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from engine.config import EngineConfig
from engine.engine_loop import EngineLoopFailed
from engine.sampling_params import SamplingParams
from engine.scheduler_output import SequenceOutput
from engine.stats import EngineStats
from proto import pdserve_pb2 as pb
from proto.convert import params_to_proto
from settings import environment
from worker.command_pipe import CommandPipe
from worker.engine_channel import (
    PIPE_BYTES,
    EngineFacts,
    FrameBuffer,
    SteadyBatchReceiver,
    config_to_json,
    facts_from_proto,
    frame,
    outputs_from_proto,
    read_frame,
    write_frame,
)
from worker.engine_process import CLOCK
from worker.state import stats_from_proto

logger = logging.getLogger(__name__)

_F_SETPIPE_SZ = 1031  # Linux
_ROOT = Path(__file__).resolve().parent.parent


class EngineStartError(RuntimeError):
    """The engine process could not build its engine (the message is the engine's own error)."""


class EngineProcess:
    def __init__(
        self,
        config: EngineConfig,
        *,
        model_name: str = "",
        idle_tick_s: float = 0.005,
        module: str = "worker.engine_process",
        role_args: tuple[str, ...] = (),
    ) -> None:
        """``module``: the process's entry point (a role's, e.g. ``decode_worker.engine_host``, with
        ``role_args``)."""
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._on_reply: dict[int, Callable[[pb.EngineReply], None]] = {}
        self._kv_hooks: list[Callable[[pb.EngineEvents], None]] = []
        # A role's part of each message (the prefill role's leases and exposed blocks), before outputs.
        self._role_hooks: list[Callable[[pb.EngineEvents], None]] = []
        # A pull's KV landed: (request id, the READ's seconds, when: the engine process's monotonic clock)
        self.on_landed: Callable[[str, float, float], None] | None = None
        self.error_kinds: dict[str, str] = {}  # request id -> its failed pull's error kind
        self._streams: dict[str, asyncio.Queue] = {}
        self._output_hooks: list[Callable[[SequenceOutput], None]] = []
        self._failure_hooks: list[Callable[[EngineLoopFailed], None]] = []
        self._events = FrameBuffer(pb.EngineEvents)
        self._batches = SteadyBatchReceiver()  # the engine's latest steady batch (engine_channel)
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.failure: EngineLoopFailed | None = None
        self.step_started = time.monotonic()
        self._work_since = 0.0  # when commands or streams last began waiting on the engine (none before)
        commands_r, commands_w = os.pipe()
        self._commands = CommandPipe(commands_w)
        self._events_r, events_w = os.pipe()
        for fd in (commands_r, events_w):
            with contextlib.suppress(OSError):  # over the system's limit: the default only waits more
                fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_BYTES)
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.NamedTemporaryFile(prefix="pdserve-engine-clock-", dir=shm, delete=False) as f:
            f.write(b"\0" * CLOCK.size)
            self._clock_path = f.name
        with open(self._clock_path, "r+b") as f:
            self._clock = mmap.mmap(f.fileno(), CLOCK.size)
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        self.process = subprocess.Popen(
            [
                sys.executable, "-m", module,
                "--commands", str(commands_r), "--events", str(events_w), "--clock", self._clock_path,
                "--model-name", model_name, "--idle-tick", str(idle_tick_s), "--log-level", str(level),
                *role_args,
            ],
            pass_fds=(commands_r, events_w),
            stdout=sys.stderr.fileno() if _has_fileno(sys.stderr) else subprocess.DEVNULL,
            env=environment.python_path_env(str(_ROOT)),
        )  # fmt: skip
        os.close(commands_r)
        os.close(events_w)
        try:
            self.facts = self._handshake(config)
        except BaseException:
            self._kill()
            raise
        finally:
            os.unlink(self._clock_path)

    def _handshake(self, config: EngineConfig) -> EngineFacts:
        write_frame(
            self._commands.fd, pb.EngineCommands(commands=[pb.EngineCommand(start=config_to_json(config))])
        )
        events = read_frame(self._events_r, pb.EngineEvents)
        if events is None or not events.replies:
            code = self.process.wait()
            raise EngineStartError(
                f"the engine process exited with status {code} before its engine was built"
            )
        reply = events.replies[0]
        if reply.error:
            self.process.wait()
            raise EngineStartError(f"{reply.error_type}: {reply.error}")
        return facts_from_proto(reply.ready)

    # What a worker uses of an EngineLoop --------------------------------------------------------

    def start(self) -> None:
        """Read the engine's events on the running event loop (the one every caller uses)."""
        self._aloop = asyncio.get_running_loop()
        os.set_blocking(self._events_r, False)
        self._aloop.add_reader(self._events_r, self._on_readable)
        self._commands.attach(self._aloop, lambda exc: self._die(f"the engine process is gone ({exc})"))

    @property
    def alive(self) -> bool:
        return self.failure is None and self._aloop is not None and self.process.poll() is None

    def add_output_hook(self, fn: Callable[[SequenceOutput], None]) -> None:
        """Run ``fn`` for every output, before it is delivered (on the event loop)."""
        self._output_hooks.append(fn)

    def add_role_hook(self, fn: Callable[[pb.EngineEvents], None]) -> None:
        """``fn`` gets every message, after its replies and before its outputs are delivered."""
        self._role_hooks.append(fn)

    def on_failure(self, fn: Callable[[EngineLoopFailed], None]) -> None:
        self._failure_hooks.append(fn)

    def open_stream(self, request_id: str) -> asyncio.Queue:
        self._note_work()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def stream_ids(self) -> list[str]:
        return list(self._streams)

    def has_stream(self, request_id: str) -> bool:
        return request_id in self._streams

    def publish(self, outputs: list[SequenceOutput]) -> None:
        for out in outputs:
            for hook in self._output_hooks:
                hook(out)
            q = self._streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _clock_values(self) -> tuple[float, float, float]:
        return CLOCK.unpack_from(self._clock, 0)

    def blocked_for(self) -> float:
        """Seconds since the engine process last finished an iteration or a step."""
        return time.monotonic() - self._clock_values()[0]

    @property
    def recent_step_s(self) -> float:
        return self._clock_values()[2]

    def stuck_for(self) -> float:
        """Seconds the engine has had work without progress, as ``EngineLoop.stuck_for``: the current
        step's age while it runs, and while commands or streams wait on the engine, the time since
        its last beat or since they began waiting, whichever came later (a process hung between
        steps, in a command or a transfer poll, no longer beats). 0 when idle or progressing."""
        beat, step_started, _ = self._clock_values()
        now = time.monotonic()
        stuck = 0.0 if beat > step_started else now - step_started
        if self._pending or self._streams:
            stuck = max(stuck, now - max(beat, self._work_since))
        return stuck

    def _note_work(self) -> None:
        """A command or stream is about to wait on the engine: if none did, the waiting starts now."""
        if not (self._pending or self._streams):
            self._work_since = time.monotonic()

    # Commands ---------------------------------------------------------------------------------

    def send(
        self, cmd: pb.EngineCommand, on_reply: Callable[[pb.EngineReply], None] | None = None
    ) -> asyncio.Future:
        """Send one command; the future settles with its reply (``ValueError`` for a refused request,
        ``EngineLoopFailed`` once the engine failed). ``on_reply`` runs with the reply as it is read,
        before anything later in its message. Event loop only."""
        fut = self._aloop.create_future()
        if self.failure is not None:
            fut.set_exception(self.failure)
            return fut
        cmd.command_id = next(self._ids)
        self._note_work()
        self._pending[cmd.command_id] = fut
        if on_reply is not None:
            self._on_reply[cmd.command_id] = on_reply
        try:
            self._commands.write(frame(pb.EngineCommands(commands=[cmd])))
        except OSError as exc:
            self._die(f"the engine process is gone ({exc})")
        return fut

    async def add_request(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        priority: int = 0,
        prefill_only: bool = False,
    ) -> None:
        add = pb.EngineAdd(
            request_id=request_id,
            prompt_token_ids=prompt,
            params=params_to_proto(params),
            priority=priority,
            prefill_only=prefill_only,
        )
        await self.send(pb.EngineCommand(add=add))

    async def abort(self, request_id: str) -> bool:
        """The request's stream (if still open) ends with finish reason ``abort``."""
        return (await self.send(pb.EngineCommand(abort=request_id))).aborted

    def abort_soon(self, request_id: str) -> None:
        """``abort`` without waiting for the answer (a stream's clean-up)."""
        if self.failure is None:
            self.send(pb.EngineCommand(abort=request_id)).add_done_callback(quiet)

    async def stats(self) -> EngineStats:
        return stats_from_proto((await self.send(pb.EngineCommand(stats=True))).stats)

    def watch_kv(self, hook: Callable[[pb.EngineEvents], None]) -> None:
        """From now on the engine sends its prefix cache's events and its load; ``hook`` gets every
        message that carries them (after its replies and outputs)."""
        self._kv_hooks.append(hook)
        self.send(pb.EngineCommand(watch_kv=True)).add_done_callback(quiet)

    def snapshot(self, on_reply: Callable[[list[bytes], list[bytes], list[bytes]], None]) -> None:
        """Every cached block's hash (KV pool, host tier, disk tier), given to ``on_reply`` as the reply
        is read (events read after it are newer than the snapshot; those before it are in it)."""
        done = self.send(
            pb.EngineCommand(snapshot=True),
            lambda r: on_reply(list(r.cached_hashes), list(r.host_hashes), list(r.disk_hashes)),
        )
        done.add_done_callback(quiet)

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the engine process to exit (any thread), and wait; kill it if it does not. Its end of
        file then ends the event reader quietly."""
        self._stopping = True
        # Behind unsent commands, or into a full pipe, the stop cannot go whole: the pipe's end of
        # file (the pipe closed here) tells the engine then.
        stop = frame(pb.EngineCommands(commands=[pb.EngineCommand(stop=True)]))
        if self.process.poll() is None and not self._commands.write_now(stop):
            self._commands.close()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("engine process %d did not stop in %.0fs; killing it", self.process.pid, timeout)
        self._kill()

    def _kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._commands.close()
        if self._aloop is None and self._events_r >= 0:  # no reader attached: nobody else closes it
            os.close(self._events_r)
            self._events_r = -1

    # Events -----------------------------------------------------------------------------------

    def _on_readable(self) -> None:
        messages: list[pb.EngineEvents] = []
        while True:
            try:
                data = os.read(self._events_r, 1 << 20)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                for events in messages:
                    self._handle(events)
                code = self.process.wait()
                self._die(f"the engine process exited (status {code}{_signal_name(code)})")
                return
            messages.extend(self._events.feed(data))
        for events in messages:
            self._handle(events)

    def _handle(self, events: pb.EngineEvents) -> None:
        for reply in events.replies:
            hook = self._on_reply.pop(reply.command_id, None)
            if hook is not None and not reply.error:
                hook(reply)
            fut = self._pending.pop(reply.command_id, None)
            if fut is None or fut.done():
                continue
            if not reply.error:
                fut.set_result(reply)
            elif reply.error_type == "ValueError":
                fut.set_exception(ValueError(reply.error))
            else:
                fut.set_exception(RuntimeError(f"{reply.error_type}: {reply.error}"))
        if self.on_landed is not None:
            for landed in events.landed:
                self.on_landed(landed.request_id, landed.seconds, landed.at)
        for out in events.outputs:
            if out.error_type:
                self.error_kinds[out.request_id] = out.error_type
        for role_hook in self._role_hooks:
            role_hook(events)
        if events.outputs or events.tokens.request_ids or events.tokens.batch:
            self.step_started = events.step_started
            self.publish(outputs_from_proto(events, self._batches))
        if events.kv_events or events.HasField("load"):
            for kv_hook in self._kv_hooks:
                kv_hook(events)
        if events.failure:
            self._die(events.failure)

    def _die(self, reason: str) -> None:
        if self._aloop is not None and self._events_r >= 0:
            self._aloop.remove_reader(self._events_r)
            os.close(self._events_r)
            self._events_r = -1
        if self.failure is not None:
            return
        if self._stopping and not self._streams:
            self.failure = EngineLoopFailed("the engine process was stopped")
            return
        failure = self.failure = EngineLoopFailed(reason)
        logger.error("engine process failed: %s; failing its %d open streams", reason, len(self._streams))
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(failure)
        self._pending.clear()
        self._on_reply.clear()
        self.publish(
            [SequenceOutput(rid, 0, [], finish_reason="error", error=str(failure)) for rid in self._streams]
        )
        for hook in self._failure_hooks:
            try:
                hook(failure)
            except Exception:
                logger.exception("engine failure hook failed")


def quiet(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: a clean-up abort that failed with its engine says nothing


def _signal_name(code: int) -> str:
    if code >= 0:
        return ""
    try:
        return f", {signal.Signals(-code).name}"
    except ValueError:
        return ""


def _has_fileno(stream) -> bool:
    try:
        stream.fileno()
        return True
    except (AttributeError, OSError, ValueError):
        return False
