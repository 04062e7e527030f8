"""The ingress's (and the CLI's) gRPC side: Generate through the router, and the cluster's state.

Generate calls all travel on one call stream to the router (``proto.call_stream``): the tokens of
every request in flight come back batched, one message per router wake-up rather than one per
request per token. The stream is the router's socket one when it serves one (``proto.socket_stream``;
its address from ``GetClusterState``), else its gRPC ``GenerateStream``. The router's address comes
from ``resolve`` (the router deployment, through a Serve handle) and is looked up again, with its
socket's, when the stream breaks (a restarted router has a new socket port, a replaced replica a new
address); a live router's own UNAVAILABLE is its answer. Only protobuf crosses these connections.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from proto.call_stream import CallMux
from proto.convert import params_to_proto
from proto.socket_stream import SocketCall
from proto.stream_limits import grpc_options

logger = logging.getLogger(__name__)


class RouterClient:
    def __init__(self, resolve: Callable[[], Awaitable[str]]) -> None:
        self._resolve = resolve
        self._address: str | None = None
        self._channel: grpc.aio.Channel | None = None
        self._calls: CallMux | None = None  # Generate calls, all on one call stream (set last)
        self._connecting = asyncio.Lock()
        self._router: pb_grpc.RouterStub | None = None  # the channel's stub, built once
        self._worker_channels: dict[str, grpc.aio.Channel] = {}

    async def _stub(self, stale: CallMux | None = None) -> pb_grpc.RouterStub:
        """The router's stub, connected once. ``stale``: the connection a caller found broken (the
        router gone, or restarted with a new socket port): looked up and connected again, unless
        another caller did so meanwhile (then its connection serves; its calls are not cut)."""
        if self._calls is not None and (stale is None or self._calls is not stale):
            return self._router
        async with self._connecting:  # one (re)connection at a time; the others wait for it
            if self._calls is None or self._calls is stale:
                address = await self._resolve()
                old, self._calls = self._calls, None
                if old is not None:
                    await old.close()  # broken: its calls have failed already
                if self._channel is not None:
                    await self._channel.close()
                self._address, self._channel = (
                    address,
                    grpc.aio.insecure_channel(address, options=grpc_options()),
                )
                self._router = pb_grpc.RouterStub(self._channel)
                # The socket's port is read again: a router restarted at the same address has a new one.
                self._calls = await self._generate_calls(self._router, address)
        return self._router

    @staticmethod
    async def _generate_calls(router: pb_grpc.RouterStub, address: str) -> CallMux:
        """The router's Generate calls on its socket call stream when it serves one (its cluster
        state says where), else on its gRPC ``GenerateStream``."""
        try:
            streams = (await router.GetClusterState(pb.ClusterStateRequest(), timeout=5)).call_streams
        except grpc.aio.AioRpcError as exc:  # Generate tells the caller what is wrong, if it still is
            logger.info("router at %s: no cluster state (%s); Generate over gRPC", address, exc.code())
            streams = ""
        if streams:
            return CallMux(functools.partial(SocketCall, streams), streams, "generate")
        return CallMux(router.GenerateStream, address, "generate")

    async def generate(
        self, request_id: str, prompt: list[int], params, priority: int, timeout_s: float
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The router's stream; a router that is gone before answering is looked up and tried again.

        Closing the iterator early cancels the call, which aborts the request down to the workers.
        """
        req = pb.GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt, params=params_to_proto(params), priority=priority
        )
        stale = None
        for attempt in range(2):
            if self._calls is None or attempt:
                await self._stub(stale)
            mux = self._calls
            call = mux.open(req, timeout=timeout_s)
            started = False
            try:
                async for msg in call:
                    started = True
                    yield msg
                return
            except grpc.aio.AioRpcError as exc:
                # Only a broken stream is looked up again: a live router's own UNAVAILABLE ("no decode
                # worker") would be its answer again, and closing its stream would cut every other call.
                if started or attempt or exc.code() != grpc.StatusCode.UNAVAILABLE or not mux.broken:
                    raise
                stale = mux
                logger.warning(
                    "router at %s unavailable (%s); looking it up again", self._address, exc.details()
                )
            finally:
                call.cancel()

    async def cluster_state(self, timeout_s: float = 5.0) -> pb.ClusterState:
        stub = await self._stub()
        mux = self._calls
        try:
            return await stub.GetClusterState(pb.ClusterStateRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            return await (await self._stub(mux)).GetClusterState(pb.ClusterStateRequest(), timeout=timeout_s)

    async def adapter(self, req: pb.AdapterRequest) -> pb.AdapterResponse:
        """Load (``path``) or unload adapter ``name`` on every worker (``router.adapters``)."""
        return await (await self._stub()).Adapter(req, timeout=120)

    async def worker_states(self, timeout_s: float = 5.0) -> tuple[pb.ClusterState, list[pb.WorkerState]]:
        """The router's view plus each live worker's own, current state (its GetState)."""
        cluster = await self.cluster_state(timeout_s)
        live = {w.state.address for w in cluster.workers}
        for address in [a for a in self._worker_channels if a not in live]:  # workers that left
            await self._worker_channels.pop(address).close()
        states = await asyncio.gather(
            *(self._worker_state(w.state, timeout_s) for w in cluster.workers), return_exceptions=True
        )
        return cluster, [s for s in states if isinstance(s, pb.WorkerState)]

    async def _worker_state(self, w: pb.WorkerState, timeout_s: float) -> pb.WorkerState:
        ch = self._worker_channels.get(w.address)
        if ch is None:
            ch = self._worker_channels[w.address] = grpc.aio.insecure_channel(w.address)
        stub_cls = pb_grpc.PrefillWorkerStub if w.role == "prefill" else pb_grpc.DecodeWorkerStub
        return await stub_cls(ch).GetState(pb.GetStateRequest(), timeout=timeout_s)

    async def close(self) -> None:
        if self._calls is not None:
            await self._calls.close()
        for ch in [self._channel, *self._worker_channels.values()]:
            if ch is not None:
                await ch.close()
