"""The prefill role: compute prompts, sample the first token, hold the prompt's KV under a lease.

A request's life here: Prefill arrives -> it joins the engine's batch (chunked prefill; prefix-cache
hits skip compute) -> its last chunk runs and the first token is sampled -> its blocks are *held*
and a KV handle goes back to the caller -> the blocks are freed by whichever comes first: the decode
worker's completion notification (sent by NIXL with its read), an explicit ``release``, or the lease
expiring. A caller that goes away before the handle is returned aborts the request (or frees its
blocks if they were already held). Every engine and NIXL call runs on the engine-loop thread.

A decode worker may read a prompt's blocks while it is still being computed (``watch_kv``): after
each step, the blocks the step finished are pinned (no preemption or abort frees them before the
request's release) and announced; the held blocks follow once the prompt is done.

With a host tier, prefill workers share prefix blocks (``worker.peer_tiers``): a request the
router sends with a ``PeerPrefix`` first reads the peer's blocks into this worker's host tier, and
``lend`` pins this worker's blocks for a peer's read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.sampling_params import SamplingParams
from engine.scheduler_output import SequenceOutput
from kv_transfer.stats import TransferStats
from prefill_worker.held import HeldPrompts
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from worker.config import WorkerConfig
from worker.peer_reads import PeerReads
from worker.runtime import RequestFailed, TransferFactory, WorkerRuntime

logger = logging.getLogger(__name__)


@dataclass
class PrefillWorkerConfig(WorkerConfig):
    worker_id: str = "prefill-0"
    lease_seconds: float = 30.0  # held KV is freed after this long
    watch_wait_s: float = 10.0  # a WatchKV for a request not seen here by then ends empty
    peer_read_timeout_s: float = 2.0  # a read of a peer's prefix blocks (Lend + READ) fails after this


@dataclass(slots=True)
class PrefillResult:
    """The first token and where its prompt's KV is held (``block_ids`` empty when finished)."""

    request_id: str
    first_token: int
    first_logprobs: dict[int, float] | None
    block_ids: list[int]
    num_tokens: int
    seed: int
    num_cached_tokens: int
    lease_expiry_unix: float
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    queue_s: float = 0.0  # arrival -> start of the step that finished the prompt
    compute_s: float = 0.0  # that step
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass(eq=False, slots=True)
class _KVWatch:
    """One reader of a prompt's blocks as they are computed."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # (newly computed block ids, whether the prompt is done); None ends the watch

    def push(self, block_ids: list[int], complete: bool = False) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (block_ids, complete))

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


class PrefillWorker(PeerReads, WorkerRuntime):
    role = "prefill"
    peer_stub = pb_grpc.PrefillWorkerStub

    def __init__(self, config: PrefillWorkerConfig, transfer_factory: TransferFactory | None = None) -> None:
        if config.lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be positive, got {config.lease_seconds}")
        if not config.peer_read_timeout_s > 0:
            raise ValueError(f"peer_read_timeout_s must be positive, got {config.peer_read_timeout_s}")
        super().__init__(config, transfer_factory)
        self.config: PrefillWorkerConfig = config
        self._watches: dict[str, _KVWatch] = {}  # each request's reader; engine thread only
        self._start_peer_reads(config.lease_seconds, config.peer_read_timeout_s)
        if self.core is not None:  # else the engine process's role does this (prefill_worker/split.py)
            self.held = HeldPrompts(self.core, config.lease_seconds, self._announce)  # engine thread only
            self.released = self.held.releases
            self.loop.add_output_hook(self._on_output)
            self.loop.add_tick(self._tick)
            self.loop.add_tick(self.held.expose)
            self.loop.on_failure(lambda _failure: [w.end() for w in self._watches.values()])
            keep_progressing = getattr(self.transfer, "keep_progressing", None)  # NIXL's; a fabric needs none
            if keep_progressing is not None:  # readers' bytes move during a step, not after it
                keep_progressing(lambda: bool(len(self.held.leases)))

    def transfer_stats(self) -> TransferStats:
        """Engine thread only: leases that expired before a decode worker read the blocks."""
        return self.held.stats

    async def busy(self) -> int:
        stats, leases = await self.loop.run(lambda: (self.core.stats(), len(self.held.leases)))
        return stats.num_running + stats.num_waiting + stats.num_swapped + leases + len(self.reading)

    # Requests ---------------------------------------------------------------------------------

    async def prefill(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        priority: int = 0,
        peer: pb.PeerPrefix | None = None,
    ) -> PrefillResult:
        """Raises ValueError for a request the engine can never serve; RuntimeError on engine error.
        ``peer``: read the prompt's first blocks from this peer first (whatever is not read is computed)."""
        if params.structured is not None:  # compiled here, not on the engine thread (cached after)
            await asyncio.to_thread(self.core.structured.compile, params.structured)
        self.check_new_id(request_id)
        stream = self.loop.open_stream(request_id)  # this call's: only it closes the stream
        clock = self.clocks.arrive(request_id)

        def add() -> None:
            self.core.add_request(request_id, prompt, params, priority=priority, prefill_only=True)
            self.clocks.ready(request_id)

        try:
            if peer is not None:
                await self.read_peer_prefix(request_id, prompt, peer, params.lora)
            await self.loop.run(add)
            out: SequenceOutput = await stream.get()
            lease = await self.loop.run(lambda: self.held.leases.get(request_id))
        except asyncio.CancelledError:  # the caller left: nobody will ever get the handle
            self.loop.call(lambda: self._abandon(request_id))
            raise
        finally:
            self.loop.close_stream(request_id)  # also when the engine refused the request
            self.clocks.forget(request_id)
        return self._result(request_id, prompt, out, clock, lease[1] if lease else 0.0)

    def check_new_id(self, request_id: str) -> None:
        """ValueError while another call waits for a prompt of this id: its stream, its clock and its
        held KV are that call's, which the refused one must not touch."""
        if self.loop.has_stream(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")

    def _result(self, request_id: str, prompt: list[int], out: SequenceOutput, clock, expiry_unix: float):
        if out.error:  # the loop's own failure fails every stream: the worker's, not the request's
            raise RuntimeError(out.error) if self.loop.failure is not None else RequestFailed(out.error)
        if out.finish_reason is not None and not out.new_token_ids:
            raise RuntimeError(f"request {request_id} ended before its first token: {out.finish_reason}")
        return PrefillResult(
            request_id=request_id,
            first_token=out.new_token_ids[0],
            first_logprobs=out.new_logprobs[0] if out.new_logprobs else None,
            block_ids=list(out.held_block_ids or []),
            num_tokens=len(prompt),
            seed=out.seed if out.seed is not None else 0,
            num_cached_tokens=out.num_cached_tokens,
            lease_expiry_unix=expiry_unix,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            queue_s=clock.queue_s,
            compute_s=clock.first_step_s,
            prompt_logprobs=out.prompt_logprobs,
        )

    async def release(self, request_id: str) -> bool:
        return await self.loop.run(lambda: self.held.release(request_id, "release"))

    async def shutdown(self, grace_s: float = 1.0) -> None:
        await super().shutdown(grace_s)
        await self._close_peer_reads()

    def stop(self) -> None:
        super().stop()
        self._stop_peer_reads()

    async def watch_kv(self, request_id: str) -> AsyncIterator[tuple[list[int], bool]]:
        """(ids of the request's prompt blocks that steps finished since the last, whether the prompt
        is done: then they are the rest of its held blocks, and the last); ends once the prompt is
        done or gone, or at once when the request is not seen here within ``watch_wait_s``."""
        watch = _KVWatch(asyncio.get_running_loop(), asyncio.Queue())
        await self.loop.run(lambda: self._start_watch(request_id, watch))
        try:
            while (item := await watch.queue.get()) is not None:
                yield item
        finally:
            self.loop.call(lambda: self._unwatch(request_id, watch))

    # Engine thread ----------------------------------------------------------------------------

    def _start_watch(self, request_id: str, watch: _KVWatch) -> None:
        old = self._watches.pop(request_id, None)
        if old is not None:
            old.end()  # one reader per request: the newer one wins
        self._watches[request_id] = watch
        self.held.start_watch(request_id, self.config.watch_wait_s)

    def _unwatch(self, request_id: str, watch: _KVWatch) -> None:
        if self._watches.get(request_id) is watch:
            del self._watches[request_id]
            self.held.watches.pop(request_id, None)

    def _announce(self, request_id: str, block_ids: list[int], complete: bool, end: bool) -> None:
        watch = self._watches.get(request_id)
        if watch is None:
            return
        if block_ids or complete:
            watch.push(block_ids, complete)
        if end:
            del self._watches[request_id]
            watch.end()

    def _on_output(self, out: SequenceOutput) -> None:
        if self.held.on_output(out) is not None and not self.loop.has_stream(out.request_id):
            self.held.release(out.request_id, "abandoned")  # the caller left before the handle

    def _abandon(self, request_id: str) -> None:
        self._drop_peer_read(request_id)
        self.core.abort_request(request_id)
        self.held.end_watch(request_id)
        self.held.release(request_id, "abandoned")

    def _tick(self) -> None:
        self.held.tick(self.transfer.get_notifications())
