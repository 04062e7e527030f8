"""The decode role: continue requests from KV pulled off a prefill worker, stream their tokens.

A disaggregated request's life here: Decode arrives with a KV handle -> the peer's NIXL metadata is
fetched once per prefill incarnation (worker id + epoch) and checked for compatibility -> the pull
(``decode_worker.kv_pull``: blocks allocated, reusing local prefix-cache hits, then READ while the
running batch keeps stepping) -> on success the prefill worker is notified (NIXL sends it with the
read) and the request joins the batch from token 2 -> tokens stream until it finishes. A failed or
timed-out read either recomputes the prompt locally (``kv_failure_policy="recompute"``) or ends the
stream with a ``KVTransferError`` (``"fail"``). Without a handle the request runs here whole
(aggregated mode; also how the router resumes a request moved here from another decode worker: the
prompt plus the tokens already streamed, the request's seed, the tokens left). A cancelled stream
aborts its request. Every engine and NIXL call runs on the engine-loop thread.

A stream this worker cannot finish ends with ``WorkerUnavailableError`` (the router resumes it
elsewhere): when the engine loop failed, and when the worker shuts down with requests still running
(``hand_off``). With ``keepalive_s`` a quiet stream carries ``Progress`` every ``keepalive_s``: the
router tells a busy worker (long prefill, queued behind others) from a stalled one by them.

Peers are kept warm by the worker itself: before it registers, and then every ``warm_interval_s``,
it connects NIXL to every prefill worker the registry lists, so first pulls pay no setup.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc

from decode_worker.kv_pull import (
    FAILURE_POLICIES,
    FailurePolicy,
    IncompatibleKVError,
    KVPuller,
    KVTransferError,
    PeerUnreachableError,
    PendingPull,
    PulledKV,
)
from decode_worker.peers import KVWatch, PeerWarmup, fetch_prefill_peer
from decode_worker.stream_output import StreamInterval, merge_outputs
from engine.sampling_params import SamplingParams
from engine.scheduler_output import SequenceOutput
from kv_transfer import RemoteKVInfo
from kv_transfer.stats import TransferStats
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from proto.quiet_timer import QuietTimer
from worker.config import WorkerConfig
from worker.peer_reads import PeerReads
from worker.runtime import RequestFailed, TransferFactory, WorkerRuntime

logger = logging.getLogger(__name__)

__all__ = [
    "FAILURE_POLICIES",
    "DecodeWorker",
    "DecodeWorkerConfig",
    "KVTransferError",
    "Progress",
    "PulledKV",
    "WorkerUnavailableError",
]

PeerFetcher = Callable[[str], Awaitable[RemoteKVInfo]]
# (prefill address, request id) -> (agent name, compat hash, block ids computed so far, all of them?)
KVWatcher = Callable[[str, str], AsyncIterator[tuple[str, str, list[int], bool]]]


@dataclass
class DecodeWorkerConfig(WorkerConfig):
    worker_id: str = "decode-0"
    kv_failure_policy: str = "recompute"  # or "fail"
    transfer_timeout_s: float = 10.0  # seconds before a KV pull fails
    warm_interval_s: float = 5.0  # how often new prefill workers are looked up and connected
    keepalive_s: float = 0.5  # a quiet Decode stream carries a Progress message this often
    stream_interval: int = 1  # tokens a stream holds before it sends them (decode_worker.stream_output)
    # Aggregated requests read a prompt's prefix from a peer decode worker's tiers (worker.peer_reads)
    peer_read_timeout_s: float = 2.0  # a read of a peer's prefix blocks (Lend + READ) fails after this
    lend_lease_s: float = 10.0  # blocks lent to a peer are pinned at most this long


class WorkerUnavailableError(RuntimeError):
    """This worker cannot go on with the request (its engine failed, or it is shutting down); the
    caller may resume it on another worker."""


@dataclass(frozen=True, slots=True)
class Progress:
    """A quiet stream's sign of life: the engine's step budget (engine.step_budget), how long its thread has gone
    without finishing an iteration, and the longest this worker stays silent."""

    step_s: float
    blocked_s: float
    interval_s: float


class DecodeWorker(PeerReads, PeerWarmup, WorkerRuntime):
    role = "decode"
    peer_stub = pb_grpc.DecodeWorkerStub

    def __init__(
        self,
        config: DecodeWorkerConfig,
        fetch_peer: PeerFetcher | None = fetch_prefill_peer,
        transfer_factory: TransferFactory | None = None,
        watch_kv: KVWatcher | None = None,
    ) -> None:
        if config.kv_failure_policy not in FAILURE_POLICIES:
            raise ValueError(
                f"kv_failure_policy must be one of {FAILURE_POLICIES}, got {config.kv_failure_policy!r}"
            )
        if not (config.peer_read_timeout_s > 0 and config.lend_lease_s > 0):
            raise ValueError("peer_read_timeout_s and lend_lease_s must be positive")
        super().__init__(config, transfer_factory)
        self.config: DecodeWorkerConfig = config
        self._start_peer_reads(config.lend_lease_s, config.peer_read_timeout_s)
        self.fetch_peer = fetch_peer  # address -> the prefill worker's RemoteKVInfo (its GetState)
        self.watch_kv = watch_kv or KVWatch()  # a prompt's blocks as its prefill worker computes them
        self.pulls: KVPuller | None = None  # None: the engine runs in a process of its own
        if self.core is not None:
            self.pulls = KVPuller(
                self.core,
                self.transfer,
                self.loop.publish,
                config.transfer_timeout_s,
                self.clocks.transferred,
            )
            self.loop.add_tick(self.pulls.tick)
            self.loop.add_hurry(self.pulls.landing)  # a hand-off read is landing
        self._init_peers()  # the prefill workers NIXL knows, and those warmed (``decode_worker.peers``)
        self._handed_off: set[str] = set()  # requests ended by hand_off (engine thread writes)
        # streamed requests awaiting their complete handle (a None result: aborted meanwhile)
        self._provided: dict[str, asyncio.Future[PulledKV | None]] = {}
        self.handing_off = False

    def transfer_stats(self) -> TransferStats | None:
        return self.pulls.stats

    async def busy(self) -> int:
        s, pulls = await self.loop.run(lambda: (self.core.stats(), len(self.pulls)))
        return s.num_running + s.num_waiting + s.num_swapped + s.num_transferring + pulls + len(self.reading)

    async def transfer_snapshot(self) -> TransferStats:
        return await self.loop.run(self.pulls.stats.snapshot)

    # Lifecycle ----

    async def drain(self, timeout_s: float = 30.0, quiet_s: float = 1.0) -> bool:
        self._stop_warmer()
        return await super().drain(timeout_s, quiet_s)

    def stop(self) -> None:
        self._stop_warmer()
        super().stop()
        self._stop_peer_reads()

    # Requests ---------------------------------------------------------------------------------

    async def check_request(self, prompt: list[int], params: SamplingParams, *, handoff: bool) -> None:
        """``ValueError`` for a request it can never serve (``handoff``: with a KV handle or source)."""
        if params.structured is not None:
            await asyncio.to_thread(self.core.structured.compile, params.structured)
        self.core.validate(prompt, params)  # the grammar compiled off the loop and engine thread

    async def decode(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        kv: PulledKV | None = None,
        policy: str | None = None,
        keepalive_s: float | None = None,
        kv_source: str | None = None,
        peer: pb.PeerPrefix | None = None,
    ) -> AsyncIterator[SequenceOutput | Progress]:
        """Stream the request's outputs (from token 2 on when ``kv`` or ``kv_source`` is given), and a
        ``Progress`` whenever nothing was sent for ``keepalive_s`` (None: never). ``kv_source``: the
        prefill worker still computing the prompt; its blocks are read as they are computed, and the
        complete handle comes through ``provide_kv``. ``peer`` (aggregated only): a decode worker to
        read the prompt's first blocks from before computing the rest (``worker.peer_reads``).

        Raises ValueError for a request the engine can never serve (``IncompatibleKVError`` for a
        peer with another KV layout), ``KVTransferError`` when the pull fails under the ``fail``
        policy, and ``WorkerUnavailableError`` when this worker cannot go on with it.
        """
        self._check_available()
        policy_ = FailurePolicy(policy or self.config.kv_failure_policy)
        if (kv is not None or kv_source) and peer is not None:
            raise ValueError("a peer to read the prefix from is for aggregated requests only")
        if self.loop.has_stream(request_id):  # another call's: refused before anything of it is touched
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = self.loop.open_stream(request_id)  # from here on this call's, closed (and aborted) below
        self.clocks.arrive(request_id)
        if kv_source:
            admit = self._admit_streamed(request_id, prompt, params, priority, kv_source, policy_)
        else:
            admit = self._admit(request_id, prompt, params, priority, kv, policy_, peer)
        quiet: QuietTimer | None = None
        try:
            if keepalive_s is None:
                admitted = await admit
            else:  # the admission may wait (an engine busy with a long step, a peer to connect)
                task = asyncio.ensure_future(admit)
                try:
                    while not (await asyncio.wait({task}, timeout=keepalive_s))[0]:
                        yield self.progress(keepalive_s)
                finally:
                    task.cancel()
                admitted = task.result()
            if not admitted:
                return  # the first token already ended the request
            unfinished = params.n  # every sample ends with its own finish reason
            hold = StreamInterval(self.config.stream_interval, first_sent=bool(kv or kv_source))
            quiet = QuietTimer(lambda: keepalive_s) if keepalive_s is not None else None
            while True:
                # Whatever the engine produced since the last look goes out as one output per
                # sample: a stream that fell behind catches up in one message, not one per token.
                if quiet is None:
                    outs = [await stream.get()]
                else:
                    try:
                        outs = [await quiet.wait(stream.get())]
                    except TimeoutError:  # quiet: what is held goes out, or a sign of life
                        outs = hold.flush() or [self.progress(keepalive_s)]
                        for out in outs:
                            yield out
                        continue
                while not stream.empty():
                    outs.append(stream.get_nowait())
                for out in hold.release(merge_outputs(outs)):
                    if out.finish_reason in ("error", "abort"):
                        self._check_available(request_id)
                    if out.error and out.finish_reason == "error":
                        raise self._request_error(request_id, out.error)
                    yield out
                    if out.finish_reason is not None:
                        unfinished -= 1
                        if unfinished == 0:
                            return
        finally:
            if quiet is not None:
                quiet.close()
            self.loop.close_stream(request_id)
            self.clocks.forget(request_id)
            self._handed_off.discard(request_id)
            if self.loop.failure is None:
                self._abort_soon(request_id)

    def _request_error(self, request_id: str, error: str) -> Exception:
        """What a stream's in-band error raises: its failed pull's error, else ``RequestFailed``."""
        return self.pulls.take_error(request_id) or RequestFailed(error)

    def _abort_soon(self, request_id: str) -> None:
        self.loop.call(lambda: self._abort(request_id))

    async def _admit(
        self, request_id, prompt, params, priority, kv, policy: FailurePolicy, peer=None
    ) -> bool:
        """Add the request (or start its pull); False when the first token already ended it.
        ``peer``: read the prompt's prefix from that decode worker first."""

        def add() -> None:
            self.core.add_request(request_id, prompt, params, priority=priority)
            self.clocks.ready(request_id)

        if kv is None:
            try:
                if peer is not None:
                    await self.read_peer_prefix(request_id, prompt, peer, params.lora)
                await self.loop.run(add)
            except asyncio.CancelledError:  # the caller left mid-read: the read is dropped
                self.loop.call(lambda: self._drop_peer_read(request_id))
                raise
            return True
        pull = PendingPull(request_id, prompt, params, priority, kv, policy)
        reachable = await self._connect_peer(pull)
        return await self._pull(pull, reachable)

    def provide_kv(self, request_id: str, kv: PulledKV) -> bool:
        """The complete KV handle of a streamed request; False when no such request waits for one."""
        waiting = self._provided.get(request_id)
        if waiting is None or waiting.done():
            return False
        waiting.set_result(kv)
        return True

    async def _admit_streamed(
        self, rid, prompt, params, priority, source: str, policy: FailurePolicy
    ) -> bool:
        """A prompt still being prefilled at ``source``: its blocks are read as they are computed
        (``_follow``) until the complete handle comes (``provide_kv``); then what is left is read. A
        watch that fails or comes late, or no room yet, leaves the pull to start whole; an early read
        that fails makes the pull a failed one (``kv_failure_policy``). An abort before the handle
        came ends the request at once (``abort``)."""
        provided = self._provided[rid] = asyncio.get_running_loop().create_future()
        follow = asyncio.ensure_future(self._follow(rid, prompt, params, priority, source, policy))
        try:
            kv = await provided
        finally:
            del self._provided[rid]
            follow.cancel()  # its engine-thread calls either ran already or never will
            await asyncio.gather(follow, return_exceptions=True)
        if kv is None:  # aborted (or handed off) while the prompt was computed
            await self._end_unstarted(rid)
            return True
        if kv.num_tokens != len(prompt):
            raise ValueError(f"KV handle covers {kv.num_tokens} tokens but the prompt has {len(prompt)}")
        started = await self._pull_finish(rid, prompt, params, priority, kv)
        if started is not None:
            return started
        return await self._admit(rid, prompt, params, priority, kv, policy)

    async def _follow(self, rid, prompt, params, priority, source: str, policy: FailurePolicy) -> None:
        began = False
        try:
            async for agent_name, compat_hash, block_ids, complete in self.watch_kv(source, rid):
                if not began:
                    kv = PulledKV(agent_name, source, [], len(prompt), compat_hash, 0, None, 0)
                    pull = PendingPull(rid, prompt, params, priority, kv, policy)
                    if not await self._connect_peer(pull):
                        return
                    if not await self._pull_early(pull):
                        return  # no room now: the pull starts whole from the complete handle
                    began = True
                self._pull_extend(rid, block_ids, complete)
        except (KVTransferError, ValueError, OSError, grpc.RpcError) as exc:
            logger.info("no early KV reads for %s from %s: %s", rid, source, exc)

    def _check_available(self, request_id: str | None = None) -> None:
        """Raise ``WorkerUnavailableError`` if the engine loop failed, or (for a new request, or one
        ``hand_off`` ended) if this worker is shutting down."""
        if self.loop.failure is not None:
            raise WorkerUnavailableError(f"decode worker {self.worker_id}: {self.loop.failure}")
        if (request_id is None and self.handing_off) or request_id in self._handed_off:
            raise WorkerUnavailableError(f"decode worker {self.worker_id} is shutting down")

    def progress(self, interval_s: float) -> Progress:
        loop = self.loop
        return Progress(loop.recent_step_s, loop.blocked_for(), interval_s)

    async def hand_off(self) -> int:
        """End every open stream with ``WorkerUnavailableError`` (the router resumes each on another
        decode worker) and free its blocks; new requests are refused. Returns how many were ended."""
        self.handing_off = True
        for rid, waiting in list(self._provided.items()):  # streamed, the prompt still computed
            if not waiting.done():
                self._handed_off.add(rid)
                waiting.set_result(None)

        def end_all() -> int:
            rids = self.loop.stream_ids()
            self._handed_off.update(rids)
            return sum(1 for rid in rids if self._abort(rid))

        return await self.loop.run(end_all) if self.loop.alive else 0

    async def shutdown(self, grace_s: float = 1.0) -> None:
        """Hand the requests still running to the router (instead of cutting their streams), give
        their streams ``grace_s`` to say so, then stop. It leaves the registry first: nothing new
        is routed here meanwhile."""
        await self.leave_registry()
        if await self.hand_off():
            deadline = asyncio.get_running_loop().time() + grace_s
            while self.loop.stream_ids() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
        await super().shutdown(grace_s)
        await self._close_peer_reads()
        if isinstance(self.watch_kv, KVWatch):
            await self.watch_kv.close()

    async def abort(self, request_id: str) -> bool:
        waiting = self._provided.get(request_id)
        if waiting is not None and not waiting.done():  # the prompt is still computed elsewhere
            waiting.set_result(None)  # its admission ends it (``_admit_streamed``)
            return True
        return await self.loop.run(lambda: self._abort(request_id))

    async def _connect_peer(self, pull: PendingPull) -> bool:
        """True when the peer is connected; False (recompute) when it cannot be reached."""
        kv = pull.kv
        if kv.compat_hash != self.compat.hash():
            raise IncompatibleKVError(
                f"KV handle of {pull.request_id} comes from an incompatible engine "
                f"({kv.compat_hash} != {self.compat.hash()}): check model, dtype and block size"
            )
        try:
            await self._ensure_peer(kv)
            return True
        except (KVTransferError, OSError, grpc.RpcError) as exc:
            if pull.policy is not FailurePolicy.RECOMPUTE:
                raise PeerUnreachableError(f"kv transfer of {pull.request_id} failed: {exc}") from exc
            logger.warning(
                "prefill worker %s unreachable (%s): recomputing %s", kv.address, exc, pull.request_id
            )
            return False

    async def _ensure_peer(self, kv: PulledKV) -> None:
        if kv.agent_name in self._peers:
            return
        if self.fetch_peer is None:
            raise PeerUnreachableError(f"no way to reach prefill worker {kv.address} for its NIXL metadata")
        info = await self.fetch_peer(kv.address)
        if info.agent_name != kv.agent_name:
            raise PeerUnreachableError(
                f"prefill worker at {kv.address} is now {info.agent_name}, not {kv.agent_name} (it restarted)"
            )
        await self._add_peer(info)
        self._peers[kv.agent_name] = kv.address

    # The engine's side of the pulls (engine thread; ``decode_worker.split``: the engine process) ----

    async def _add_peer(self, info: RemoteKVInfo) -> None:
        await self.loop.run(lambda: self.transfer.add_peer(info))

    async def _pull(self, pull: PendingPull, reachable: bool) -> bool:
        return await self.loop.run(lambda: self.pulls.start(pull, reachable=reachable))

    async def _pull_early(self, pull: PendingPull) -> bool:
        return await self.loop.run(lambda: self.pulls.begin_early(pull))

    def _pull_extend(self, rid: str, block_ids: list[int], complete: bool) -> None:
        self.loop.call(lambda: self.pulls.extend(rid, block_ids, complete))

    async def _pull_finish(self, rid, prompt, params, priority, kv: PulledKV) -> bool | None:
        return await self.loop.run(lambda: self.pulls.finish_early(rid, kv))

    async def _end_unstarted(self, rid: str) -> None:
        """A streamed request aborted before its complete handle came: its early pull settles."""

        def end() -> None:
            if self.pulls.abort(rid) is None:  # no early pull: nothing to settle
                self.loop.publish([SequenceOutput(rid, 0, [], finish_reason="abort")])

        await self.loop.run(end)

    def _abort(self, rid: str) -> bool:
        """Engine thread. The request's stream (if still open) ends with finish reason ``abort``."""
        pulled = self.pulls.abort(rid)
        if pulled is not None:
            return pulled
        outs = self.core.abort_request(rid)
        self.loop.publish(outs)
        return bool(outs)
