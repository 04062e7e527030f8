"""The decode role: continue requests from KV pulled off a prefill worker, stream their tokens.

A disaggregated request's life here: Decode arrives with a KV handle -> the peer's NIXL metadata is
fetched once per prefill incarnation (worker id + epoch) and checked for compatibility -> blocks
are allocated, reusing local prefix-cache hits -> the missing blocks are READ over NIXL while the
running batch keeps stepping (the loop's tick polls the transfer) -> on success the prefill worker is
notified (NIXL sends it with the read) and the request joins the batch from token 2 -> tokens
stream until it finishes. A failed or timed-out read either recomputes the prompt locally
(``kv_failure_policy="recompute"``) or ends the stream with an error (``"fail"``); a request never
decodes from blocks it did not fully receive, and its blocks are freed only once the read settled.
Without a handle the request runs here whole (aggregated mode). A cancelled stream aborts its
request. Every engine and NIXL call runs on the engine-loop thread.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc

from engine.config import EngineConfig
from engine.engine_core import EngineCore, EngineStats
from engine.engine_loop import EngineLoop
from engine.sampling_params import SamplingParams
from engine.scheduler_output import SequenceOutput
from kv_transfer import RemoteKVInfo, TransferState
from kv_transfer.engine_agent import engine_agent
from kv_transfer.stats import TransferStats
from proto.registry_publisher import RegistryPublisher, publish_worker
from proto.worker_process import drain_worker

logger = logging.getLogger(__name__)

FAILURE_POLICIES = ("recompute", "fail")


@dataclass(slots=True)
class DecodeWorkerConfig:
    engine: EngineConfig
    worker_id: str = "decode-0"
    kv_failure_policy: str = "recompute"
    transfer_timeout_s: float = 10.0
    model_name: str | None = None
    redis_url: str | None = None  # registry + KV events (Redis); None: standalone


@dataclass(frozen=True, slots=True)
class PulledKV:
    """What the decode side needs of a prefill worker's KV handle."""

    agent_name: str
    address: str
    block_ids: list[int]
    num_tokens: int
    compat_hash: str
    first_token: int
    first_logprobs: dict[int, float] | None
    seed: int
    lease_expiry_unix: float = 0.0  # the prefill side frees the blocks then (0: unknown)


@dataclass(slots=True)
class _Transfer:
    handle: object | None
    agent: str
    policy: str
    started: float  # time.monotonic() at start_read
    aborted: bool = False


@dataclass(slots=True)
class _WaitingPull:
    args: tuple  # (prompt, params, priority, kv, policy)
    give_up_at: float  # time.monotonic(): then recompute locally


class KVTransferError(RuntimeError):
    pass


class DecodeWorker:
    role = "decode"

    def __init__(
        self,
        config: DecodeWorkerConfig,
        fetch_peer: Callable[[str], Awaitable[RemoteKVInfo]] | None = None,
    ) -> None:
        if config.kv_failure_policy not in FAILURE_POLICIES:
            raise ValueError(
                f"kv_failure_policy must be one of {FAILURE_POLICIES}, got {config.kv_failure_policy!r}"
            )
        self.config = config
        self.worker_id = config.worker_id
        self.epoch = time.time_ns()
        self.core = EngineCore(config.engine)
        self.compat, self.transfer = engine_agent(
            self.core, self.worker_id, self.epoch, config.model_name or str(config.engine.model)
        )
        self.fetch_peer = fetch_peer  # address -> the prefill worker's RemoteKVInfo (its GetState)
        self.loop = EngineLoop(self.core)
        self.loop.add_tick(self._tick)
        self.registry: RegistryPublisher | None = None
        self.draining = False
        self.transfers: dict[str, _Transfer] = {}  # engine thread only
        self._waiting_pulls: dict[str, _WaitingPull] = {}  # engine thread only; FIFO
        self._quarantine: dict[str, object] = {}  # held-block key -> unsettled transfer handle
        self._peers: set[str] = set()
        self.transfer_stats = TransferStats()  # engine thread only

    def start(self) -> None:
        self.loop.start()

    def attach_registry(self, address: str) -> None:
        """Register in Redis under ``address`` and publish this worker's KV events (from the loop)."""
        if self.config.redis_url:
            self.registry = publish_worker(self, address, self.config.redis_url)

    def stop(self) -> None:
        self.loop.stop()
        if self.registry is not None:
            self.registry.stop()
        self.transfer.close()

    async def drain(self, timeout_s: float = 30.0) -> bool:
        """Leave the registry (no new routes), then wait for running work to end; False on timeout."""
        return await drain_worker(self, self._busy, timeout_s)

    async def _busy(self) -> int:
        s, waiting = await self.loop.run(lambda: (self.core.stats(), len(self._waiting_pulls)))
        return s.num_running + s.num_waiting + s.num_swapped + s.num_transferring + waiting

    def transfer_info(self) -> RemoteKVInfo:
        return self.transfer.local_info()

    async def stats(self) -> EngineStats:
        return await self.loop.run(self.core.stats)

    async def transfer_snapshot(self) -> TransferStats:
        return await self.loop.run(self.transfer_stats.snapshot)

    # Requests ---------------------------------------------------------------------------------

    async def decode(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        kv: PulledKV | None = None,
        policy: str | None = None,
    ) -> AsyncIterator[SequenceOutput]:
        """Stream the request's outputs (from token 2 on when ``kv`` is given).

        Raises ValueError for a request the engine can never serve or an incompatible peer, and
        KVTransferError when the pull fails under the ``fail`` policy.
        """
        policy = policy or self.config.kv_failure_policy
        stream = self.loop.open_stream(request_id)
        try:
            if kv is None:
                await self.loop.run(
                    lambda: self.core.add_request(request_id, prompt, params, priority=priority)
                )
            else:
                if kv.compat_hash != self.compat.hash():
                    raise ValueError(
                        f"KV handle of {request_id} comes from an incompatible engine "
                        f"({kv.compat_hash} != {self.compat.hash()}): check model, dtype and block size"
                    )
                try:
                    await self._ensure_peer(kv)
                    reachable = True
                except (KVTransferError, OSError, grpc.RpcError) as exc:
                    if policy != "recompute":
                        raise KVTransferError(f"kv transfer of {request_id} failed: {exc}") from exc
                    logger.warning(
                        "prefill worker %s unreachable (%s): recomputing %s", kv.address, exc, request_id
                    )
                    reachable = False
                started = await self.loop.run(
                    lambda: self._start_pull(request_id, prompt, params, priority, kv, policy, reachable)
                )
                if not started:  # the first token already ended the request
                    return
            unfinished = params.n  # every sample ends with its own finish reason
            while True:
                out: SequenceOutput = await stream.get()
                if out.error and out.finish_reason == "error":
                    raise (
                        KVTransferError(out.error)
                        if out.error.startswith("kv transfer")
                        else RuntimeError(out.error)
                    )
                yield out
                if out.finish_reason is not None:
                    unfinished -= 1
                    if unfinished == 0:
                        return
        finally:
            self.loop.close_stream(request_id)
            self.loop.call(lambda: self._abort(request_id))

    async def abort(self, request_id: str) -> bool:
        return await self.loop.run(lambda: self._abort(request_id))

    async def warm_peers(self, addresses: list[str]) -> int:
        """Connect NIXL to these prefill workers now (their metadata, UCX endpoints), so the first
        pull from each pays no setup. Unreachable ones are skipped; returns how many were added."""
        added = 0
        for address in addresses:
            if self.fetch_peer is None:
                break
            try:
                info = await self.fetch_peer(address)
            except (OSError, grpc.RpcError, ValueError) as exc:
                logger.info("prefill worker %s not warmed (%s)", address, exc)
                continue
            if info.agent_name in self._peers:
                continue
            await self.loop.run(lambda info=info: self.transfer.add_peer(info))
            self._peers.add(info.agent_name)
            added += 1
        return added

    async def _ensure_peer(self, kv: PulledKV) -> None:
        if kv.agent_name in self._peers:
            return
        if self.fetch_peer is None:
            raise KVTransferError(f"no way to reach prefill worker {kv.address} for its NIXL metadata")
        info = await self.fetch_peer(kv.address)
        if info.agent_name != kv.agent_name:
            raise KVTransferError(
                f"prefill worker at {kv.address} is now {info.agent_name}, not {kv.agent_name} (it restarted)"
            )
        await self.loop.run(lambda: self.transfer.add_peer(info))
        self._peers.add(kv.agent_name)

    # Engine thread ----------------------------------------------------------------------------

    def _start_pull(self, rid, prompt, params, priority, kv: PulledKV, policy: str, reachable: bool) -> bool:
        """Allocate the prompt's blocks and start the READ; with no room for them right now the pull
        waits (FIFO, while the prefill lease lasts) instead of failing the request."""
        args = (prompt, params, priority, kv, policy)
        if reachable and self._waiting_pulls:  # behind earlier waiters: keep their order
            self._wait_for_room(rid, args)
            return True
        try:
            return self._pull(rid, *args, reachable=reachable)
        except RuntimeError:  # no room for the blocks now (the engine queues, it never fails)
            if not reachable:
                self._recompute(rid, *args, notify=False)
            else:
                self._wait_for_room(rid, args)
            return True

    def _wait_for_room(self, rid: str, args: tuple) -> None:
        kv: PulledKV = args[3]
        lease_left = kv.lease_expiry_unix - time.time() - 1.0 if kv.lease_expiry_unix else math.inf
        wait = max(0.0, min(self.config.transfer_timeout_s, lease_left))
        self.transfer_stats.waited += 1
        self._waiting_pulls[rid] = _WaitingPull(args, time.monotonic() + wait)

    def _recompute(self, rid, prompt, params, priority, kv: PulledKV, policy, notify: bool = True) -> None:
        """Give up on the peer's KV: free it there, and compute the prompt here (the engine queues the
        request until blocks free up).

        NOTE: the first token was already streamed by the router, so it joins the prompt and one token
        less is left to generate: positions, and so seeded samples, are those of one engine."""
        if notify:
            self.transfer.send_notification(kv.agent_name, rid.encode())
        self.transfer_stats.recomputed += 1
        rest = dataclasses.replace(params, seed=kv.seed, max_tokens=params.max_tokens - 1)
        self.core.add_request(rid, [*prompt, kv.first_token], rest, priority=priority)

    def _retry_waiting_pulls(self) -> None:
        now = time.monotonic()
        for rid, w in list(self._waiting_pulls.items()):
            if now >= w.give_up_at:
                del self._waiting_pulls[rid]
                logger.info("no KV room for %s before its lease ends: recomputing it locally", rid)
                self._recompute(rid, *w.args)
                continue
            try:
                self._pull(rid, *w.args, reachable=True)
            except RuntimeError:
                return  # still no room; later waiters stay behind this one
            del self._waiting_pulls[rid]

    def _pull(self, rid, prompt, params, priority, kv: PulledKV, policy: str, *, reachable: bool) -> bool:
        plan = self.core.add_transferred_request(
            rid,
            prompt,
            kv.first_token,
            params,
            seed=kv.seed,
            first_logprobs=kv.first_logprobs,
            priority=priority,
        )
        notify = rid.encode()
        if not reachable:
            if plan is not None:
                self.transfer_stats.recomputed += 1
                self.core.fail_transfer(rid)  # recompute locally, the first token kept
            return plan is not None
        if plan is None:
            self.transfer.send_notification(kv.agent_name, notify)
            return False
        remote = kv.block_ids[plan.first_block_index : plan.first_block_index + len(plan.local_block_ids)]
        if not plan.local_block_ids:  # everything was a local prefix hit
            self.transfer.send_notification(kv.agent_name, notify)
            self.core.complete_transfer(rid)
            return True
        handle = self.transfer.start_read(
            kv.agent_name, remote, plan.local_block_ids, notify, self.config.transfer_timeout_s
        )
        self.transfers[rid] = _Transfer(handle, kv.agent_name, policy, time.monotonic())
        self.transfer_stats.bytes += len(remote) * self.core.layout.block_bytes
        return True

    def _tick(self) -> None:
        if self._waiting_pulls:
            self._retry_waiting_pulls()
        for rid, t in list(self.transfers.items()):
            state = self.transfer.poll(t.handle)
            if state == TransferState.IN_PROGRESS:
                continue
            del self.transfers[rid]
            if state == TransferState.DONE:
                self.transfer.release(t.handle)
                if t.aborted:
                    self.loop.publish(self.core.abort_request(rid))
                else:
                    self.transfer_stats.record_done(time.monotonic() - t.started)
                    self.core.complete_transfer(rid)
                continue
            # NOTE: NIXL cannot abort a READ in flight: until the backend says the local blocks are
            # reusable, they stay allocated (quarantined) and the request goes on without them.
            if not t.handle.local_blocks_reusable:
                self._quarantine[self.core.quarantine_blocks(rid)] = t.handle
            else:
                self.transfer.release(t.handle)
            self.transfer_stats.failures += 1
            if t.aborted:
                self.loop.publish(self.core.abort_request(rid))
            elif t.policy == "recompute":
                logger.warning("KV pull of %s failed: recomputing its prompt locally", rid)
                self.transfer_stats.recomputed += 1
                self.core.fail_transfer(rid)
            else:
                self.loop.publish(self.core.fail_request(rid, f"kv transfer of {rid} failed or timed out"))
        for key, handle in list(self._quarantine.items()):
            self.transfer.poll(handle)
            if handle.local_blocks_reusable:
                self.transfer.release(handle)
                self.core.release_held(key)
                del self._quarantine[key]

    def _abort(self, rid: str) -> bool:
        w = self._waiting_pulls.pop(rid, None)
        if w is not None:  # nothing allocated here yet; free the peer's blocks now
            self.transfer.send_notification(w.args[3].agent_name, rid.encode())
            return True
        t = self.transfers.get(rid)
        if t is not None:
            t.aborted = True  # freed by _tick once the read has settled
            return True
        return bool(self.core.abort_request(rid))
