"""Finding prefill workers to pull from: their NIXL metadata (from their GetState) and the ones
the registry lists.

A prefill incarnation (its address and epoch in the registry) is warmed once: a worker restarted at
the same address is a new one. Once the registry stops listing an incarnation and its address no
longer answers as its agent (dead, or restarted as another), the decode worker drops it from its
NIXL agent. One that still answers is kept: a draining worker leaves the registry first, and its
held prompts are still read."""

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


Incarnation = tuple[str, int]  # a prefill worker's (address, epoch)


def registered_prefill_workers(redis_url: str) -> list[Incarnation]:
    """The live prefill workers in the registry (blocking: run in a thread)."""
    client = connect(redis_url)
    try:
        return sorted((w.address, w.epoch) for w in read_workers(client).values() if w.role == "prefill")
    finally:
        client.close()


class PeerWarmup:
    """A decode worker keeps its NIXL peers warm itself: before it registers it connects to every
    prefill worker the registry lists, then every ``warm_interval_s`` to new ones, so first pulls pay
    no setup. Mixed into ``DecodeWorker`` (its config, ``fetch_peer``, ``_add_peer``, ``_remove_peer``)."""

    def _init_peers(self) -> None:
        self._peers: dict[str, str] = {}  # agent names NIXL knows -> their address
        self._warmed: dict[Incarnation, str] = {}  # listed prefill incarnations reached -> their agent
        self._warmer: asyncio.Task | None = None

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
        listed = await asyncio.to_thread(registered_prefill_workers, self.config.redis_url)
        await self._drop_gone(set(listed))
        added = 0
        for incarnation in [i for i in listed if i not in self._warmed]:
            reached = await self._warm(incarnation[0])  # the ones not reached are tried again
            if reached is not None:
                self._warmed[incarnation], new = reached
                added += new
        if added:
            logger.info("%s: NIXL connected to %d new prefill workers", self.worker_id, added)
        return added

    async def _drop_gone(self, listed: set[Incarnation]) -> None:
        """Forget the incarnations no longer listed; drop their peers once their address no longer
        answers as them (and no listed incarnation is the same agent)."""
        gone = {i: agent for i, agent in self._warmed.items() if i not in listed}
        if not gone:
            return
        answers = await asyncio.gather(*(self.fetch_peer(a) for a, _ in gone), return_exceptions=True)
        kept = {agent for i, agent in self._warmed.items() if i in listed}
        for (incarnation, agent), answer in zip(gone.items(), answers):
            alive = isinstance(answer, RemoteKVInfo) and answer.agent_name == agent
            if alive and agent not in kept:
                continue  # still serving (draining): asked again next time
            del self._warmed[incarnation]
            if agent not in kept and self._peers.pop(agent, None) is not None:
                logger.info("%s: prefill worker %s (%s) is gone", self.worker_id, agent, incarnation[0])
                await self._remove_peer(agent)

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
            reached = await self._warm(address)
            added += reached is not None and reached[1]
        return added

    async def _warm(self, address: str) -> tuple[str, bool] | None:
        """(its agent name, whether it was added now) of the prefill worker at ``address``; None
        when it cannot be reached."""
        if self.fetch_peer is None:
            return None
        try:
            info = await self.fetch_peer(address)
        except (OSError, grpc.RpcError, ValueError) as exc:
            logger.info("prefill worker %s not warmed (%s)", address, exc)
            return None
        if info.agent_name in self._peers:
            return info.agent_name, False
        await self._add_peer(info)
        self._peers[info.agent_name] = address
        return info.agent_name, True

    async def _remove_peer(self, agent_name: str) -> None:
        """Engine thread (``decode_worker.split``: the engine process): its reads in flight fail."""
        await self.loop.run(lambda: self.transfer.remove_peer(agent_name))
