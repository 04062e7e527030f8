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
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.sampling_params import SamplingParams
from engine.scheduler_output import SequenceOutput
from kv_transfer.stats import TransferStats
from worker.config import WorkerConfig
from worker.runtime import RequestFailed, TransferFactory, WorkerRuntime

logger = logging.getLogger(__name__)


@dataclass
class PrefillWorkerConfig(WorkerConfig):
    worker_id: str = "prefill-0"
    lease_seconds: float = 30.0  # held KV is freed after this long
    watch_wait_s: float = 10.0  # a WatchKV for a request not seen here by then ends empty


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


@dataclass(slots=True)
class _Lease:
    expiry: float  # time.monotonic()
    expiry_unix: float


@dataclass(eq=False, slots=True)
class _KVWatch:
    """One reader of a prompt's blocks as they are computed."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # (newly computed block ids, whether the prompt is done); None ends the watch
    deadline: float | None  # time.monotonic() by which the request must show up (None: it did)
    sent: int = 0  # blocks announced so far (engine thread)

    def push(self, block_ids: list[int], complete: bool = False) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (block_ids, complete))

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


class PrefillWorker(WorkerRuntime):
    role = "prefill"

    def __init__(self, config: PrefillWorkerConfig, transfer_factory: TransferFactory | None = None) -> None:
        if config.lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be positive, got {config.lease_seconds}")
        super().__init__(config, transfer_factory)
        self.config: PrefillWorkerConfig = config
        if self.core is not None:  # else the engine process's role does this (prefill_worker/split.py)
            self.loop.add_output_hook(self._on_output)
            self.loop.add_tick(self._tick)
            self.loop.add_tick(self._expose)
            self.loop.on_failure(lambda _failure: [w.end() for w in self._watches.values()])
        self.leases: dict[str, _Lease] = {}  # engine thread only
        self.released = {"notification": 0, "release": 0, "expiry": 0, "abandoned": 0}
        self._transfer = TransferStats()  # the prefill side's share: leases that expired unread
        self._watches: dict[str, _KVWatch] = {}  # engine thread only (a failing loop ends them)

    def transfer_stats(self) -> TransferStats:
        """Engine thread only: leases that expired before a decode worker read the blocks."""
        return self._transfer

    async def busy(self) -> int:
        stats, leases = await self.loop.run(lambda: (self.core.stats(), len(self.leases)))
        return stats.num_running + stats.num_waiting + stats.num_swapped + leases

    # Requests ---------------------------------------------------------------------------------

    async def prefill(
        self, request_id: str, prompt: list[int], params: SamplingParams, priority: int = 0
    ) -> PrefillResult:
        """Raises ValueError for a request the engine can never serve; RuntimeError on engine error."""
        if params.structured is not None:  # compiled here, not on the engine thread (cached after)
            await asyncio.to_thread(self.core.structured.compile, params.structured)
        stream = self.loop.open_stream(request_id)
        clock = self.clocks.arrive(request_id)

        def add() -> None:
            self.core.add_request(request_id, prompt, params, priority=priority, prefill_only=True)
            self.clocks.ready(request_id)

        try:
            await self.loop.run(add)
            out: SequenceOutput = await stream.get()
            lease = await self.loop.run(lambda: self.leases.get(request_id))
        except asyncio.CancelledError:  # the caller left: nobody will ever get the handle
            self.loop.call(lambda: self._abandon(request_id))
            raise
        finally:
            self.loop.close_stream(request_id)  # also when the engine refused the request
            self.clocks.forget(request_id)
        if out.held_block_ids is None:  # nothing held: no reader may rely on its exposed blocks
            self.loop.call(lambda: self.core.unpin(request_id))
        return self._result(request_id, prompt, out, clock, lease.expiry_unix if lease else 0.0)

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
        return await self.loop.run(lambda: self._release(request_id, "release"))

    async def watch_kv(self, request_id: str) -> AsyncIterator[tuple[list[int], bool]]:
        """(ids of the request's prompt blocks that steps finished since the last, whether the prompt
        is done: then they are the rest of its held blocks, and the last); ends once the prompt is
        done or gone, or at once when the request is not seen here within ``watch_wait_s``."""
        watch = _KVWatch(
            asyncio.get_running_loop(), asyncio.Queue(), time.monotonic() + self.config.watch_wait_s
        )
        await self.loop.run(lambda: self._start_watch(request_id, watch))
        try:
            while (item := await watch.queue.get()) is not None:
                yield item
        finally:
            self.loop.call(
                lambda: (
                    self._watches.pop(request_id, None) if self._watches.get(request_id) is watch else None
                )
            )

    # Engine thread ----------------------------------------------------------------------------

    def _start_watch(self, request_id: str, watch: _KVWatch) -> None:
        held = self.core.kv.held.get(request_id) if request_id in self.leases else None
        if held is not None:  # done already: all of it at once
            watch.push(list(held), complete=True)
            watch.end()
            return
        old = self._watches.get(request_id)
        if old is not None:
            old.end()  # one reader per request: the newer one wins
        self._watches[request_id] = watch

    def _end_watch(self, request_id: str, rest: list[int] | None = None) -> None:
        watch = self._watches.pop(request_id, None)
        if watch is not None:
            if rest is not None:
                watch.push(rest[watch.sent :], complete=True)
            watch.end()

    def _expose(self) -> None:
        """After each step: announce (and pin) the watched prompts' newly computed blocks."""
        now = time.monotonic()
        for rid, watch in list(self._watches.items()):
            if watch.deadline is not None:
                if rid in self.core.scheduler.requests:
                    watch.deadline = None
                elif now > watch.deadline:
                    self._end_watch(rid)
                    continue
            ids = self.core.expose_computed(rid, watch.sent)
            if ids:
                watch.sent += len(ids)
                watch.push(ids)

    def _on_output(self, out: SequenceOutput) -> None:
        if out.held_block_ids is None:
            if out.finish_reason is not None:  # ended before its blocks were held: no more to read
                self._end_watch(out.request_id)
            return
        self._end_watch(out.request_id, out.held_block_ids)
        now = time.monotonic()
        self.leases[out.request_id] = _Lease(
            now + self.config.lease_seconds, time.time() + self.config.lease_seconds
        )
        if not self.loop.has_stream(out.request_id):  # the caller left before the handle was ready
            self._release(out.request_id, "abandoned")

    def _abandon(self, request_id: str) -> None:
        self.core.abort_request(request_id)
        self._end_watch(request_id)
        self._release(request_id, "abandoned")

    def _release(self, request_id: str, why: str) -> bool:
        self.core.unpin(request_id)
        if self.leases.pop(request_id, None) is None:
            return False  # already freed: a late notification or a repeated release is harmless
        self.core.release_held(request_id)
        self.released[why] += 1
        logger.debug("released %s (%s)", request_id, why)
        return True

    def _tick(self) -> None:
        for _peer, msg in self.transfer.get_notifications():
            self._release(msg.decode("utf-8", "replace"), "notification")
        if self.leases:
            now = time.monotonic()
            for rid in [r for r, lease in self.leases.items() if lease.expiry <= now]:
                logger.warning("lease of %s expired: freeing its blocks", rid)
                self._release(rid, "expiry")
                self._transfer.expired_leases += 1
