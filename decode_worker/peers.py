"""Finding prefill workers to pull from: their NIXL metadata (from their GetState) and the ones
the registry lists."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from kv_transfer import RemoteKVInfo
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from registry.schema import connect, read_workers
from worker.state import transfer_info_from_proto

logger = logging.getLogger(__name__)


async def fetch_prefill_peer(address: str, timeout_s: float = 10.0) -> RemoteKVInfo:
    """A prefill worker's NIXL metadata, from its GetState (protobuf over gRPC, never pickle)."""
    async with grpc.aio.insecure_channel(address) as channel:
        state = await pb_grpc.PrefillWorkerStub(channel).GetState(pb.GetStateRequest(), timeout=timeout_s)
    return transfer_info_from_proto(state.transfer)


class KVWatch:
    """Follows prompts being prefilled, over one cached channel per prefill worker."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def __call__(
        self, address: str, request_id: str
    ) -> AsyncIterator[tuple[str, str, list[int], bool]]:
        """(agent name, compat hash, the prompt's block ids computed so far, whether that is all of
        them) from the prefill worker at ``address``, once per step that finished blocks of it; ends
        when the prompt is done or gone."""
        channel = self._channels.get(address) or self._channels.setdefault(
            address, grpc.aio.insecure_channel(address)
        )
        call = pb_grpc.PrefillWorkerStub(channel).WatchKV(pb.WatchKVRequest(request_id=request_id))
        try:
            async for progress in call:
                h = progress.handle
                yield h.agent_name, h.compat_hash, list(h.block_ids), progress.complete
        finally:
            call.cancel()

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


def registered_prefill_addresses(redis_url: str) -> list[str]:
    """The gRPC addresses of the live prefill workers in the registry (blocking: run in a thread)."""
    client = connect(redis_url)
    try:
        return sorted(w.address for w in read_workers(client).values() if w.role == "prefill")
    finally:
        client.close()


class PeerWarmup:
    """A decode worker keeps its NIXL peers warm itself: before it registers it connects to every
    prefill worker the registry lists, then every ``warm_interval_s`` to new ones, so first pulls pay
    no setup. Mixed into ``DecodeWorker`` (its config, ``fetch_peer``, ``_add_peer``)."""

    async def before_register(self) -> None:
        """Connect to the registered prefill workers before becoming routable, then keep doing so."""
        if not self.config.redis_url or self.fetch_peer is None:
            return
        try:
            await self.warm_from_registry()
        except Exception as exc:  # Redis away: pulls still connect lazily
            logger.info("peer warm-up skipped: %s", exc)
        self._warmer = asyncio.get_running_loop().create_task(self._keep_warm())

    async def warm_from_registry(self) -> int:
        addresses = await asyncio.to_thread(registered_prefill_addresses, self.config.redis_url)
        new = [a for a in addresses if a not in self._warmed]
        if not new:
            return 0
        added = await self.warm_peers(new)  # marks the ones it reached as warmed; the rest retry
        logger.info("%s: NIXL connected to %d new prefill workers", self.worker_id, added)
        return added

    async def _keep_warm(self) -> None:
        while True:
            await asyncio.sleep(self.config.warm_interval_s)
            try:
                await self.warm_from_registry()
            except Exception as exc:  # Redis away: the pull path still connects lazily
                logger.info("peer warm-up skipped: %s", exc)

    def _stop_warmer(self) -> None:
        task, self._warmer = self._warmer, None
        if task is not None and not task.done():
            loop = task.get_loop()
            if not loop.is_closed():
                loop.call_soon_threadsafe(task.cancel)

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
            self._warmed.add(address)
            if info.agent_name in self._peers:
                continue
            await self._add_peer(info)
            self._peers.add(info.agent_name)
            added += 1
        return added
