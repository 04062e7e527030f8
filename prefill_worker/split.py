"""A prefill worker whose engine runs in a process of its own (``engine_process``).

The worker process keeps the gRPC server and answers Prefill, Release, WatchKV and GetState; the
engine process (``prefill_worker.engine_host``) runs the engine loop, the NIXL agent registered over
the engine's KV memory (decode workers read held prompts there and notify it when done), the leases
and the watched prompts' exposed blocks. Each request's add, release and watch is a command; each
iteration's message carries the leases taken, the watched blocks and the outputs
(``worker.engine_channel``). No gRPC work ever delays a step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from engine.sampling_params import SamplingParams
from kv_transfer.stats import TransferStats
from prefill_worker.held import RELEASES
from prefill_worker.worker import PrefillResult, PrefillWorker, PrefillWorkerConfig, _KVWatch
from proto import pdserve_pb2 as pb
from worker.engine_client import quiet
from worker.state import stats_from_proto, transfer_stats_from_proto, worker_state_to_proto

TRANSFERS = ("nixl", "inprocess")


class SplitPrefillWorker(PrefillWorker):
    def __init__(self, config: PrefillWorkerConfig, transfer: str = "nixl") -> None:
        if not config.engine_process:
            raise ValueError("SplitPrefillWorker needs engine_process=True")
        if transfer not in TRANSFERS:
            raise ValueError(f"transfer must be one of {TRANSFERS}, got {transfer!r}")
        self.transfer_kind = transfer  # read by engine_module, which the runtime calls
        super().__init__(config)
        self._expiry_unix: dict[str, float] = {}  # leases taken for requests whose caller waits
        self._split_watches: dict[str, _KVWatch] = {}
        self._stats = TransferStats()  # the engine process's, as of the last stats reply
        self.released = dict.fromkeys(RELEASES, 0)
        self.engine.add_role_hook(self._on_events)
        self.engine.on_failure(self._end_watches)  # nothing more will be announced

    def _end_watches(self, _failure=None) -> None:
        watches, self._split_watches = self._split_watches, {}
        for watch in watches.values():
            watch.end()

    def engine_module(self) -> tuple[str, tuple[str, ...]]:
        agent = f"{self.worker_id}-{self.epoch}"  # a restarted worker is a new peer
        lease = str(self.config.lease_seconds)
        role_args = ("--transfer", self.transfer_kind, "--agent-name", agent, "--lease-seconds", lease)
        role_args += ("--peer-read-timeout", str(self.config.peer_read_timeout_s))
        return "prefill_worker.engine_host", role_args

    def _on_events(self, events: pb.EngineEvents) -> None:
        """Event loop: a message's leases (before its outputs) and watched blocks."""
        for lease in events.leases:
            if self.loop.has_stream(lease.request_id):
                self._expiry_unix[lease.request_id] = lease.expiry_unix
        for exposed in events.exposed:
            watch = self._split_watches.get(exposed.request_id)
            if watch is None:
                continue
            if exposed.block_ids or exposed.complete:
                watch.push(list(exposed.block_ids), complete=exposed.complete)
            if exposed.end:
                del self._split_watches[exposed.request_id]
                watch.end()

    async def prefill(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        priority: int = 0,
        peer: pb.PeerPrefix | None = None,
    ) -> PrefillResult:
        """Raises ValueError for a request the engine can never serve; RuntimeError on engine error.
        A grammar compiles in the engine process (on its helper thread)."""
        self.check_new_id(request_id)
        stream = self.loop.open_stream(request_id)  # this call's: only it closes the stream
        clock = self.clocks.arrive(request_id)
        try:
            if peer is not None:
                await self.read_peer_prefix(request_id, prompt, peer, params.lora)
            await self.engine.add_request(request_id, prompt, params, priority, prefill_only=True)
            self.clocks.ready(request_id)
            out = await stream.get()
        except asyncio.CancelledError:  # the caller left: a held prompt is freed, a running one aborted
            self.engine.abort_soon(request_id)
            raise
        finally:
            self.loop.close_stream(request_id)
            self.clocks.forget(request_id)
            expiry = self._expiry_unix.pop(request_id, 0.0)
        return self._result(request_id, prompt, out, clock, expiry)

    async def release(self, request_id: str) -> bool:
        released = (await self.engine.send(pb.EngineCommand(release=request_id))).released
        self.released["release"] += released  # the engine's count, until its next stats reply
        return released

    async def watch_kv(self, request_id: str) -> AsyncIterator[tuple[list[int], bool]]:
        """One reader per request, the newer one winning. A reader is registered when its watch
        command's reply is read: what the engine announced before that was for the older reader (the
        engine starts each reader from the prompt's first block), and the reply precedes the blocks
        announced after it in the same message."""
        watch = _KVWatch(asyncio.get_running_loop(), asyncio.Queue())
        old = self._split_watches.pop(request_id, None)
        if old is not None:
            old.end()
        closed = False

        def register(_reply: pb.EngineReply) -> None:
            if closed:  # the reader left before the engine had its watch
                self._unwatch(request_id)
                return
            newer = self._split_watches.get(request_id)
            if newer is not None:
                newer.end()
            self._split_watches[request_id] = watch

        try:
            start = pb.EngineWatch(request_id=request_id, wait_s=self.config.watch_wait_s)
            await self.engine.send(pb.EngineCommand(watch=start), register)
            while (item := await watch.queue.get()) is not None:
                yield item
        finally:
            closed = True
            if self._split_watches.get(request_id) is watch:
                del self._split_watches[request_id]
                self._unwatch(request_id)

    def _unwatch(self, request_id: str) -> None:
        if self.engine.failure is None:
            self.engine.send(pb.EngineCommand(unwatch=request_id)).add_done_callback(quiet)

    async def _engine_stats(self) -> pb.EngineReply:
        reply = await self.engine.send(pb.EngineCommand(stats=True))
        self._stats = transfer_stats_from_proto(reply.transfer_stats)
        self.released.update(reply.releases)
        return reply

    def transfer_stats(self) -> TransferStats:
        return self._stats

    async def busy(self) -> int:
        reply = await self._engine_stats()
        s = reply.stats
        return s.num_running + s.num_waiting + s.num_swapped + reply.num_leases + len(self.reading)

    async def get_state(self) -> pb.WorkerState:
        reply = await self._engine_stats()
        stats = stats_from_proto(reply.stats)
        return worker_state_to_proto(self, self.address, stats, self._stats.snapshot())


def build_prefill_worker(config: PrefillWorkerConfig, *, transfer: str = "nixl", **kwargs) -> PrefillWorker:
    """The prefill worker ``config`` asks for: its engine in-process, or in a process of its own."""
    if config.engine_process:
        return SplitPrefillWorker(config, transfer=transfer)
    return PrefillWorker(config, **kwargs)
