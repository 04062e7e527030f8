"""Finding prefill workers to pull from: their NIXL metadata (from their GetState) and the ones
the registry lists."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from kv_transfer import RemoteKVInfo
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from registry.schema import connect, read_workers
from worker.state import transfer_info_from_proto


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
