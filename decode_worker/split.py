"""A decode worker whose engine runs in a process of its own (``engine_process``).

The worker process keeps the gRPC server, the streams (``--stream-interval``, keep-alive), admission,
the edge's validation and what needs the network for a KV hand-off (a prefill worker's NIXL metadata
from its GetState, a streamed prompt's watch); the engine process (``decode_worker.engine_host``)
runs the engine loop and the KV pulls, whose NIXL agent is registered over the engine's memory there.
No gRPC or stream work ever delays a step: on a GPU host the step's host side is the GPU's critical
path. The two talk over pipes: one message per command, one per step carrying every sequence's
outputs (``worker.engine_channel``).

``transfer``: ``nixl`` (disaggregated and aggregated requests, as an in-process worker serves them)
or ``none`` (aggregated only: the worker registers with ``kv_handoff=0`` so the router computes its
prompts there, and a Decode with a KV handle or a ``kv_source`` is refused with INVALID_ARGUMENT).
"""

from __future__ import annotations

import asyncio

from decode_worker.kv_pull import (
    FailurePolicy,
    IncompatibleKVError,
    KVTransferError,
    PeerUnreachableError,
    PendingPull,
    PulledKV,
)
from decode_worker.peers import fetch_prefill_peer
from decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from engine.sampling_params import SamplingParams
from engine.scheduler_output import SequenceOutput
from kv_transfer import RemoteKVInfo
from kv_transfer.stats import TransferStats
from proto import pdserve_pb2 as pb
from proto.convert import logprobs_to_proto, params_to_proto
from worker.engine_client import quiet
from worker.runtime import RequestFailed
from worker.state import (
    stats_from_proto,
    transfer_info_to_proto,
    transfer_stats_from_proto,
    worker_state_to_proto,
)

TRANSFERS = ("nixl", "none")
NO_HANDOFF = (
    "decode worker {wid} runs its engine in a process of its own without a KV transfer agent and takes "
    "no KV hand-offs: serve it aggregated (no prefill workers), or start it with --kv-transfer nixl"
)
_ERRORS = {e.__name__: e for e in (KVTransferError, PeerUnreachableError, IncompatibleKVError)}


class SplitDecodeWorker(DecodeWorker):
    def __init__(
        self, config: DecodeWorkerConfig, transfer: str = "none", fetch_peer=fetch_prefill_peer
    ) -> None:
        if not config.engine_process:
            raise ValueError("SplitDecodeWorker needs engine_process=True")
        if transfer not in TRANSFERS:
            raise ValueError(f"transfer must be one of {TRANSFERS}, got {transfer!r}")
        self.transfer_kind = transfer  # read by engine_module, which the runtime calls
        super().__init__(config, fetch_peer=fetch_peer if transfer != "none" else None)
        self.engine.on_landed = self.clocks.transferred
        self._pull_stats = TransferStats()  # the engine process's, as of the last stats reply

    def engine_module(self) -> tuple[str, tuple[str, ...]]:
        if self.transfer_kind == "none":
            return "worker.engine_process", ()
        agent = f"{self.worker_id}-{self.epoch}"  # a restarted worker is a new peer
        timeout = str(self.config.transfer_timeout_s)
        return "decode_worker.engine_host", (
            "--transfer",
            "nixl",
            "--agent-name",
            agent,
            "--transfer-timeout",
            timeout,
            "--peer-read-timeout",
            str(self.config.peer_read_timeout_s),
            "--lend-lease-seconds",
            str(self.config.lend_lease_s),
        )

    @property
    def takes_handoffs(self) -> bool:
        return self.engine.facts.transfer is not None

    @property
    def reads_peers(self) -> bool:
        """Its engine process reads and lends a peer's prefix blocks when it has a transfer agent (and
        a host tier: without one, a read ends at once and nothing is lent)."""
        return self.takes_handoffs

    async def check_request(self, prompt: list[int], params: SamplingParams, *, handoff: bool) -> None:
        """The engine's limits (a grammar compiles in the engine process, on its helper thread)."""
        if handoff and not self.takes_handoffs:
            raise ValueError(NO_HANDOFF.format(wid=self.worker_id))
        self.limits.check(prompt, params)

    def transfer_stats(self) -> TransferStats:
        return self._pull_stats

    async def transfer_snapshot(self) -> TransferStats:
        await self._engine_stats()
        return self._pull_stats.snapshot()

    async def _engine_stats(self) -> pb.EngineReply:
        """The engine's statistics (its pulls' kept for ``transfer_stats``)."""
        reply = await self.engine.send(pb.EngineCommand(stats=True))
        if reply.HasField("transfer_stats"):
            self._pull_stats = transfer_stats_from_proto(reply.transfer_stats)
        return reply

    async def busy(self) -> int:
        reply = await self._engine_stats()
        s = reply.stats
        waiting = reply.pending_pulls + len(self._provided) + len(self.reading)
        return s.num_running + s.num_waiting + s.num_swapped + s.num_transferring + waiting

    async def get_state(self) -> pb.WorkerState:
        reply = await self._engine_stats()
        return worker_state_to_proto(self, self.address, stats_from_proto(reply.stats), self._pull_stats)

    async def before_register(self) -> None:
        if self.takes_handoffs:
            await super().before_register()

    async def _admit(
        self, request_id, prompt, params, priority, kv: PulledKV | None, policy: FailurePolicy, peer=None
    ) -> bool:
        if kv is None:
            if peer is not None:  # a cancelled read is dropped by the abort that follows (``decode``)
                await self.read_peer_prefix(request_id, prompt, peer, params.lora)
            await self.engine.add_request(request_id, prompt, params, priority)
            self.clocks.ready(request_id)
            return True
        if not self.takes_handoffs:
            raise ValueError(NO_HANDOFF.format(wid=self.worker_id))
        return await super()._admit(request_id, prompt, params, priority, kv, policy)

    async def _admit_streamed(self, rid, prompt, params, priority, source, policy) -> bool:
        if not self.takes_handoffs:
            raise ValueError(NO_HANDOFF.format(wid=self.worker_id))
        return await super()._admit_streamed(rid, prompt, params, priority, source, policy)

    # The engine's side of the pulls, as commands to the engine process --------------------------

    async def _add_peer(self, info: RemoteKVInfo) -> None:
        await self.engine.send(pb.EngineCommand(add_peer=transfer_info_to_proto(info)))

    async def _remove_peer(self, agent_name: str) -> None:
        await self.engine.send(pb.EngineCommand(remove_peer=agent_name))

    async def _pull(self, pull: PendingPull, reachable: bool) -> bool:
        return (await self.engine.send(pb.EngineCommand(pull=_pull_message(pull, reachable)))).started

    async def _pull_early(self, pull: PendingPull) -> bool:
        return (await self.engine.send(pb.EngineCommand(pull_early=_pull_message(pull, True)))).started

    def _pull_extend(self, rid: str, block_ids: list[int], complete: bool) -> None:
        extend = pb.EngineExtend(request_id=rid, block_ids=block_ids, complete=complete)
        self.engine.send(pb.EngineCommand(pull_extend=extend)).add_done_callback(quiet)

    async def _pull_finish(self, rid, prompt, params, priority, kv: PulledKV) -> bool | None:
        pull = PendingPull(rid, prompt, params, priority, kv, FailurePolicy.RECOMPUTE)
        reply = await self.engine.send(pb.EngineCommand(pull_finish=_pull_message(pull, True)))
        return reply.started if reply.HasField("started") else None

    async def _end_unstarted(self, rid: str) -> None:
        if not await self.engine.abort(rid):  # no early pull there: nothing to settle
            self.loop.publish([SequenceOutput(rid, 0, [], finish_reason="abort")])

    def _request_error(self, request_id: str, error: str) -> Exception:
        kind = _ERRORS.get(self.engine.error_kinds.pop(request_id, ""))
        return kind(error) if kind is not None else RequestFailed(error)

    def _abort_soon(self, request_id: str) -> None:
        self.engine.abort_soon(request_id)

    async def abort(self, request_id: str) -> bool:
        waiting = self._provided.get(request_id)
        if waiting is not None and not waiting.done():  # the prompt is still computed elsewhere
            waiting.set_result(None)
            return True
        return await self.engine.abort(request_id)

    async def hand_off(self) -> int:
        self.handing_off = True
        for rid, waiting in list(self._provided.items()):
            if not waiting.done():
                self._handed_off.add(rid)
                waiting.set_result(None)
        if not self.engine.alive:
            return 0
        rids = self.loop.stream_ids()
        self._handed_off.update(rids)
        ended = await asyncio.gather(*(self.engine.abort(rid) for rid in rids), return_exceptions=True)
        return sum(1 for e in ended if e is True)


def _pull_message(pull: PendingPull, reachable: bool) -> pb.EnginePull:
    kv = pull.kv
    request = pb.EngineAdd(
        request_id=pull.request_id,
        prompt_token_ids=pull.prompt,
        params=params_to_proto(pull.params),
        priority=pull.priority,
    )
    handle = pb.KVHandle(
        request_id=kv.owner_request_id,
        agent_name=kv.agent_name,
        address=kv.address,
        block_ids=kv.block_ids,
        num_tokens=kv.num_tokens,
        compat_hash=kv.compat_hash,
        first_token=kv.first_token,
        seed=kv.seed,
        lease_expiry_unix=kv.lease_expiry_unix,
    )
    if kv.first_logprobs is not None:
        handle.first_logprobs.CopyFrom(logprobs_to_proto(kv.first_logprobs))
    return pb.EnginePull(request=request, handle=handle, policy=pull.policy.value, reachable=reachable)


def build_decode_worker(config: DecodeWorkerConfig, *, transfer: str = "nixl", **kwargs) -> DecodeWorker:
    """The decode worker ``config`` asks for: its engine in-process, or in a process of its own
    (``transfer``: nixl, or none for aggregated serving only)."""
    if config.engine_process:
        return SplitDecodeWorker(config, transfer=transfer)
    return DecodeWorker(config, **kwargs)
