"""``python -m worker.engine_process``: an engine core in a process of its own, driven over two pipes.

A worker started with ``engine_process`` runs this (``worker.engine_client`` spawns it): the
process's one busy thread runs ``EngineCore.step()`` with nothing else on its GIL (no gRPC, no
asyncio, no stream bookkeeping), the way vLLM's EngineCore process and SGLang's scheduler process
do. Each iteration it reads whatever commands arrived (``EngineCommands``: add, abort, stats,
snapshot), runs them, runs one step if anything is unfinished, and writes one ``EngineEvents``
message with the commands' replies and the step's outputs for all its sequences. When there is
nothing to do it waits on the command pipe for up to ``idle_tick_s``, twice as long after each turn
that brought nothing, up to ``IDLE_WAIT_MAX_S``: a command still wakes it at once, and an idle
engine process costs 0.8% of a core instead of 4% (200 empty turns a second, measured on 2 cores).

Once watched (``watch_kv``), each message also carries the prefix cache's block events and, every
``LOAD_INTERVAL_S``, the engine's load: the worker publishes them to the registry (its publisher's
Redis work stays off this process's GIL). ``snapshot`` answers with every cached block's hash.

A grammar compiles on a helper thread (as the in-process loop's callers do), so a request with a
new grammar never stalls the running batch; its add lands when the grammar is ready.

A shared clock file (three float64s, written every iteration: the thread's last beat, the current
step's start, the step budget: engine.step_budget) lets the worker tell a stalled engine from a busy one without
a message. If a step raises, the process says so (``failure``) and exits 1.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import mmap
import os
import select
import signal
import struct
import sys
import time
from collections.abc import Callable

from engine.engine_core import EngineCore
from engine.scheduler_output import PlainTokens, SequenceOutput
from engine.step_budget import StepBudget
from kv_transfer import KVCompat
from proto import pdserve_pb2 as pb
from proto.convert import params_from_proto
from settings import gc_policy
from worker.adapters import change_adapter
from worker.engine_channel import (
    FrameBuffer,
    SteadyBatchSender,
    config_from_json,
    outputs_to_proto,
    read_frame,
    ready_to_proto,
    write_frame,
)
from worker.registry_link import event_batches
from worker.state import stats_to_proto

logger = logging.getLogger(__name__)

# beat, step_started (time.monotonic(), system-wide), and the step budget (``engine.step_budget``)
CLOCK = struct.Struct("<3d")
# The longest wait of an idle engine for its next command: what a NIXL notification or a lease's end
# can wait while nothing else happens (a block freed that much later), and the clock's beat's age.
IDLE_WAIT_MAX_S = 0.05
LOAD_INTERVAL_S = 0.25  # the registry's heartbeat (1 s) takes the latest load


class EngineRole:
    """What a worker role adds to its engine process (``decode_worker.engine_host``: the KV pulls,
    which must run where the engine's KV memory is). Every method runs on the engine's thread."""

    def ready(self, msg: pb.EngineReady) -> None:
        """Add what peers need to the ready message."""

    def run(self, cmd: pb.EngineCommand, reply: pb.EngineReply) -> bool:
        """Run a command of the role's; False: not one of them."""
        return False

    def abort(self, request_id: str) -> bool | None:
        """End a request the role holds (publishing its outputs): whether it was there, or None to
        leave it to the engine's own abort."""
        return None

    def tick(self) -> None:
        """After every command batch, before the step."""

    def hurry(self) -> bool:
        """True: poll again without waiting for a command (something is about to land)."""
        return False

    def stats(self, reply: pb.EngineReply) -> None:
        """Add the role's statistics to a stats reply."""

    def finish(self, events: pb.EngineEvents, outputs: list[SequenceOutput]) -> dict[str, str]:
        """Add the role's part to an iteration's message; returns the error kind of outputs whose
        error is the role's (request id -> e.g. "KVTransferError")."""
        return {}


class EngineHost:
    def __init__(
        self,
        core: EngineCore,
        commands_fd: int,
        events_fd: int,
        clock: mmap.mmap,
        idle_tick_s: float,
        role: EngineRole | None = None,
    ):
        self.core = core
        self.role = role or EngineRole()
        self.published: list[SequenceOutput] = []  # outputs made between steps (``publish``)
        self.commands_fd = commands_fd
        self.events_fd = events_fd
        self.clock = clock
        self.idle_tick_s = idle_tick_s
        self.frames = FrameBuffer(pb.EngineCommands)
        self.batches = SteadyBatchSender()  # a steady batch's members cross the channel once
        self.compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self.compiling: list[tuple[concurrent.futures.Future, pb.EngineCommand]] = []
        self.answered: list[pb.EngineReply] = []  # replies to commands other than the one being run
        self.watching = False  # send the cache's events and the load (the worker publishes them)
        self.next_load = 0.0
        self.beat = self.step_started = time.monotonic()
        self.steps = core.step_budget = StepBudget(on_start=self._tick_clock)
        self.stopping = False
        os.set_blocking(commands_fd, False)

    def serve(self) -> bool:
        """Run until told to stop (True) or a step fails (False)."""
        core = self.core
        wait = self.idle_tick_s
        while not self.stopping:
            self.beat = time.monotonic()
            self._tick_clock()
            busy = core.has_work() or bool(self.compiling) or self.role.hurry()
            if not busy:
                select.select([self.commands_fd], [], [], wait)
            replies: list[pb.EngineReply] = []
            outputs = self.published
            commands = self._read_commands()
            for cmd in commands:
                replies.append(self._run(cmd, outputs))
            replies.extend(self.answered)  # adds an abort answered while their grammar compiled
            self.answered.clear()
            idle = not (busy or commands or outputs)
            wait = min(2 * wait, IDLE_WAIT_MAX_S) if idle else self.idle_tick_s
            self._land_compiled(replies)
            self.role.tick()
            step_started = time.monotonic()
            plain = PlainTokens()  # the step's plain outputs, kept as columns (sent as such)
            if core.has_work():
                self.step_started = self.beat = step_started
                self._tick_clock()
                try:
                    outputs.extend(core.step(plain))
                except Exception as exc:
                    logger.exception("engine step failed")
                    self._fail(f"engine step failed: {type(exc).__name__}: {exc}")
                    return False
                self.beat = time.monotonic()
                self.steps.finished(self.beat - step_started)
            self.published = []
            events = pb.EngineEvents(replies=replies, step_started=self.step_started)
            kinds = self.role.finish(events, outputs)
            # What came before the step (replies' outputs, aborts) precedes its plain tokens.
            positions = [0] * (len(outputs) - len(plain.marks)) + plain.marks
            outputs_to_proto(outputs, events, plain, positions, self.batches)
            for out in events.outputs if kinds else ():
                out.error_type = kinds.get(out.request_id, "")
            if self.watching:
                self._add_kv_state(events)
            if (
                replies
                or outputs
                or plain.tokens
                or events.kv_events
                or events.HasField("load")
                or events.landed
                or events.leases
                or events.exposed
            ):
                write_frame(self.events_fd, events)
        return True

    def publish(self, outputs: list[SequenceOutput]) -> None:
        """Outputs made outside a step (a role's failed pull): sent with this iteration's."""
        self.published.extend(outputs)

    def _add_kv_state(self, events: pb.EngineEvents) -> None:
        for kind, hashes in event_batches(self.core.drain_kv_events()):
            events.kv_events.add(kind=kind, hashes=hashes)
        now = time.monotonic()
        if now >= self.next_load:
            self.next_load = now + LOAD_INTERVAL_S
            s = self.core.stats()
            events.load.num_running = s.num_running
            events.load.num_waiting = s.num_waiting
            events.load.num_free_blocks = s.num_free_blocks
            events.load.queued_prompt_tokens = self.core.pending_prompt_tokens()
            events.load.host_hit_cost_pct = self.core.host_hit_cost_pct()
            events.load.disk_hit_cost_pct = self.core.disk_hit_cost_pct()
            events.load.peer_hit_cost_pct = self.core.peer_hit_cost_pct()
            events.load.resident_loras.extend(self.core.resident_loras())

    def _tick_clock(self) -> None:
        CLOCK.pack_into(self.clock, 0, self.beat, self.step_started, self.steps.budget_s)

    def _read_commands(self) -> list[pb.EngineCommand]:
        commands: list[pb.EngineCommand] = []
        while True:
            try:
                data = os.read(self.commands_fd, 1 << 20)
            except BlockingIOError:
                return commands
            if not data:  # the worker is gone: nothing will read our outputs
                self.stopping = True
                return commands
            for batch in self.frames.feed(data):
                commands.extend(batch.commands)

    def _run(self, cmd: pb.EngineCommand, outputs: list[SequenceOutput]) -> pb.EngineReply | None:
        reply = pb.EngineReply(command_id=cmd.command_id)
        kind = cmd.WhichOneof("kind")
        try:
            if kind == "add":
                params = params_from_proto(cmd.add.params)
                if params.structured is not None:
                    fut = self.compiler.submit(self.core.structured.compile, params.structured)
                    self.compiling.append((fut, cmd))
                    return None
                self._add(cmd.add, params)
            elif kind == "abort":
                reply.aborted = self._abort(cmd.abort, outputs)
            elif kind == "stats":
                reply.stats.CopyFrom(stats_to_proto(self.core.stats()))
                self.role.stats(reply)
            elif kind == "watch_kv":
                self.watching, self.next_load = True, 0.0
            elif kind == "snapshot":
                self.core.drain_kv_events()  # the snapshot holds what they say
                device, host, disk = self.core.cached_hashes()
                reply.cached_hashes.extend(device)
                reply.host_hashes.extend(host)
                reply.disk_hashes.extend(disk)
            elif kind == "stop":
                self.stopping = True
            elif kind == "adapter":
                reply.loras.update(change_adapter(self.core, cmd.adapter))
            elif not self.role.run(cmd, reply):
                raise ValueError(f"unknown engine command {kind!r}")
        except Exception as exc:  # the caller gets it; the engine goes on
            reply.error, reply.error_type = str(exc), type(exc).__name__
        return reply

    def _add(self, add: pb.EngineAdd, params) -> None:
        self.core.add_request(
            add.request_id,
            list(add.prompt_token_ids),
            params,
            priority=add.priority,
            prefill_only=add.prefill_only,
        )

    def _abort(self, request_id: str, outputs: list[SequenceOutput]) -> bool:
        """End the request (its stream gets finish reason abort); False when it was not here."""
        for i, (fut, cmd) in enumerate(self.compiling):
            if cmd.add.request_id == request_id:  # not added yet: it never will be
                fut.cancel()
                del self.compiling[i]
                # Its add is answered (the worker waits for it before it reads the stream), and every
                # sample ends aborted, as the engine ends a request it had.
                self.answered.append(pb.EngineReply(command_id=cmd.command_id))
                n = max(1, cmd.add.params.n)
                outputs.extend(SequenceOutput(request_id, j, [], finish_reason="abort") for j in range(n))
                return True
        held = self.role.abort(request_id)  # its outputs published through ``publish``
        if held is not None:
            return held
        outs = self.core.abort_request(request_id)
        outputs.extend(outs)
        return bool(outs)

    def _land_compiled(self, replies: list[pb.EngineReply | None]) -> None:
        """Adds whose grammar compiled meanwhile join now, in arrival order."""
        replies[:] = [r for r in replies if r is not None]
        while self.compiling and self.compiling[0][0].done():
            fut, cmd = self.compiling.pop(0)
            reply = pb.EngineReply(command_id=cmd.command_id)
            try:
                fut.result()
                self._add(cmd.add, params_from_proto(cmd.add.params))
            except Exception as exc:
                reply.error, reply.error_type = str(exc), type(exc).__name__
            replies.append(reply)

    def _fail(self, reason: str) -> None:
        write_frame(self.events_fd, pb.EngineEvents(failure=reason))


RoleFactory = Callable[[EngineHost, KVCompat, list[str]], EngineRole]


def main(argv: list[str] | None = None, role: RoleFactory | None = None) -> None:
    """``role``: builds the worker role's part from the host, the KV compatibility and the
    arguments this parser does not know (``decode_worker.engine_host``)."""
    p = argparse.ArgumentParser(prog="python -m worker.engine_process", description=__doc__)
    p.add_argument("--commands", type=int, required=True, help="descriptor to read EngineCommands from")
    p.add_argument("--events", type=int, required=True, help="descriptor to write EngineEvents to")
    p.add_argument("--clock", required=True, help="the shared clock file (CLOCK.size bytes)")
    p.add_argument("--model-name", default="", help="the name peers check KV compatibility against")
    p.add_argument("--idle-tick", type=float, default=0.005)
    p.add_argument("--log-level", default="WARNING")
    args, extra = p.parse_known_args(argv)
    if extra and role is None:
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    start = read_frame(args.commands, pb.EngineCommands)
    if start is None or not start.commands or start.commands[0].WhichOneof("kind") != "start":
        sys.exit("engine process: the first command must be start")
    cmd = start.commands[0]
    with open(args.clock, "r+b") as f:
        clock = mmap.mmap(f.fileno(), CLOCK.size)
    try:
        config = config_from_json(cmd.start)
        core = EngineCore(config)
    except Exception as exc:  # the worker raises it (a bad option, a model that does not load)
        reply = pb.EngineReply(command_id=cmd.command_id, error=str(exc), error_type=type(exc).__name__)
        write_frame(args.events, pb.EngineEvents(replies=[reply]))
        sys.exit(1)
    compat = KVCompat.from_layout(args.model_name or str(config.model), core.layout)
    host = EngineHost(core, args.commands, args.events, clock, args.idle_tick)
    if role is not None:
        host.role = role(host, compat, extra)
    ready = ready_to_proto(core.limits, compat, core.prefix_salt, core.lora_salts())
    host.role.ready(ready)
    gc_policy.settle_heap()
    write_frame(
        args.events, pb.EngineEvents(replies=[pb.EngineReply(command_id=cmd.command_id, ready=ready)])
    )
    try:
        ok = host.serve()
    except BrokenPipeError:  # the worker went away mid-write
        ok = True
    finally:
        core.close()  # the disk tier's file
    sys.exit(0 if ok else 1)


def run(role: RoleFactory | None = None) -> None:
    """The process's entry point: a signal to the worker's process group (Ctrl-C, a supervisor's
    SIGTERM) is the worker's to handle: it drains, then stops this process; if the worker dies
    instead, the command pipe's end says so."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    main(role=role)


if __name__ == "__main__":
    run()
