"""The prefill role: compute prompts, sample the first token, hold the prompt's KV under a lease.

A request's life here: Prefill arrives -> it joins the engine's batch (chunked prefill; prefix-cache
hits skip compute) -> its last chunk runs and the first token is sampled -> its blocks are *held*
and a KV handle goes back to the caller -> the blocks are freed by whichever comes first: the decode
worker's completion notification (sent by NIXL with its read), an explicit ``release``, or the lease
expiring. A caller that goes away before the handle is returned aborts the request (or frees its
blocks if they were already held). Every engine and NIXL call runs on the engine-loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from engine.sampling_params import SamplingParams
from engine.scheduler_output import SequenceOutput
from kv_transfer.stats import TransferStats
from worker.config import WorkerConfig
from worker.runtime import TransferFactory, WorkerRuntime

logger = logging.getLogger(__name__)


@dataclass
class PrefillWorkerConfig(WorkerConfig):
    worker_id: str = "prefill-0"
    lease_seconds: float = 30.0  # held KV is freed after this long


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


class PrefillWorker(WorkerRuntime):
    role = "prefill"

    def __init__(self, config: PrefillWorkerConfig, transfer_factory: TransferFactory | None = None) -> None:
        if config.lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be positive, got {config.lease_seconds}")
        super().__init__(config, transfer_factory)
        self.config: PrefillWorkerConfig = config
        self.loop.add_output_hook(self._on_output)
        self.loop.add_tick(self._tick)
        self.leases: dict[str, _Lease] = {}  # engine thread only
        self.released = {"notification": 0, "release": 0, "expiry": 0, "abandoned": 0}
        self._transfer = TransferStats()  # the prefill side's share: leases that expired unread

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
        if out.error:
            raise RuntimeError(out.error)
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
            lease_expiry_unix=lease.expiry_unix if lease else 0.0,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            queue_s=clock.queue_s,
            compute_s=clock.first_step_s,
            prompt_logprobs=out.prompt_logprobs,
        )

    async def release(self, request_id: str) -> bool:
        return await self.loop.run(lambda: self._release(request_id, "release"))

    # Engine thread ----------------------------------------------------------------------------

    def _on_output(self, out: SequenceOutput) -> None:
        if out.held_block_ids is None:
            return
        now = time.monotonic()
        self.leases[out.request_id] = _Lease(
            now + self.config.lease_seconds, time.time() + self.config.lease_seconds
        )
        if not self.loop.has_stream(out.request_id):  # the caller left before the handle was ready
            self._release(out.request_id, "abandoned")

    def _abandon(self, request_id: str) -> None:
        self.core.abort_request(request_id)
        self._release(request_id, "abandoned")

    def _release(self, request_id: str, why: str) -> bool:
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
