"""A decode worker whose engine runs in a process of its own (``engine_process``).

The worker process keeps the gRPC server, the streams (``--stream-interval``, keep-alive), admission
and the edge's validation; the engine process (``worker.engine_process``) runs only the engine loop,
so no gRPC or stream work ever delays a step (on a GPU host the step's host side is the GPU's
critical path). The two talk over pipes: one message per command, one per step carrying every
sequence's outputs.

It serves requests whole (aggregated mode, and the router's migrations, which resume a request from
its prompt and the tokens already streamed). It takes no KV hand-offs: its engine's KV memory lives
in the other process, where no NIXL agent is registered, so a Decode with a KV handle or a
``kv_source`` is refused (INVALID_ARGUMENT) naming the fix; serve disaggregated pools without
``engine_process``.
"""

from __future__ import annotations

import asyncio

from decode_worker.kv_pull import FailurePolicy, PulledKV
from decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from engine.sampling_params import SamplingParams
from kv_transfer.stats import TransferStats
from worker.runtime import RequestFailed

NO_HANDOFF = (
    "decode worker {wid} runs its engine in a process of its own and takes no KV hand-offs: serve it "
    "aggregated (no prefill workers), or start it without --engine-process"
)


class SplitDecodeWorker(DecodeWorker):
    def __init__(self, config: DecodeWorkerConfig) -> None:
        if not config.engine_process:
            raise ValueError("SplitDecodeWorker needs engine_process=True")
        super().__init__(config, fetch_peer=None)
        self._no_pulls = TransferStats()

    async def check_request(self, prompt: list[int], params: SamplingParams, *, handoff: bool) -> None:
        """The engine's limits (a grammar compiles in the engine process, on its helper thread)."""
        if handoff:
            raise ValueError(NO_HANDOFF.format(wid=self.worker_id))
        self.limits.check(prompt, params)

    def transfer_stats(self) -> TransferStats:
        return self._no_pulls

    async def transfer_snapshot(self) -> TransferStats:
        return self._no_pulls.snapshot()

    async def busy(self) -> int:
        s = await self.engine.stats()
        return s.num_running + s.num_waiting + s.num_swapped + len(self._provided)

    async def before_register(self) -> None:
        return None  # no NIXL peers to warm: it pulls no KV

    async def _admit(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        priority: int,
        kv: PulledKV | None,
        policy: FailurePolicy,
    ) -> bool:
        if kv is not None:
            raise ValueError(NO_HANDOFF.format(wid=self.worker_id))
        await self.engine.add_request(request_id, prompt, params, priority)
        self.clocks.ready(request_id)
        return True

    async def _admit_streamed(self, rid, prompt, params, priority, source, policy) -> bool:
        raise ValueError(NO_HANDOFF.format(wid=self.worker_id))

    def _request_error(self, request_id: str, error: str) -> Exception:
        return RequestFailed(error)

    def _abort_soon(self, request_id: str) -> None:
        self.engine.abort_soon(request_id)

    async def abort(self, request_id: str) -> bool:
        return await self.engine.abort(request_id)

    async def hand_off(self) -> int:
        self.handing_off = True
        if not self.engine.alive:
            return 0
        rids = self.loop.stream_ids()
        self._handed_off.update(rids)
        ended = await asyncio.gather(*(self.engine.abort(rid) for rid in rids), return_exceptions=True)
        return sum(1 for e in ended if e is True)


def build_decode_worker(config: DecodeWorkerConfig, **kwargs) -> DecodeWorker:
    """The decode worker ``config`` asks for: its engine in-process, or in a process of its own."""
    return SplitDecodeWorker(config) if config.engine_process else DecodeWorker(config, **kwargs)
