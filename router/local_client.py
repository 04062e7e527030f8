"""The router as a client of the same process: what the ingress calls when the router replica serves
HTTP itself (``http_server: router``), with no gRPC hop between them.

It answers like ``RouterClient``: the same ``GenerateResponse`` messages, and failures as the
``grpc.aio.AioRpcError`` the ingress maps to HTTP statuses, so the ingress cannot tell the two apart.
A cancelled caller (the HTTP client went away) cancels the router's stream, which aborts the request
down to the workers, as closing a gRPC call does.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc

from engine.sampling_params import SamplingParams
from proto import pdserve_pb2 as pb
from router.client import RouterClient
from router.router import Router
from router.service import RouteFailed, RouterService, caller_stream


class LocalRouterClient(RouterClient):
    def __init__(self, router: Router) -> None:
        super().__init__(self._no_address)
        self.router = router
        self._service = RouterService(router)

    @staticmethod
    async def _no_address() -> str:
        raise RuntimeError("the router is in this process; it has no address to look up")

    async def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams, priority: int, timeout_s: float
    ) -> AsyncIterator[pb.GenerateResponse]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            async for msg in caller_stream(self.router, request_id, list(prompt), params, priority, deadline):
                yield msg
        except RouteFailed as exc:
            raise grpc.aio.AioRpcError(
                exc.code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=exc.details
            ) from None

    async def adapter(self, req: pb.AdapterRequest) -> pb.AdapterResponse:
        from router.adapters import AdapterChangeFailed, change_adapter

        try:
            return pb.AdapterResponse(workers=await change_adapter(self.router, req))
        except AdapterChangeFailed as exc:
            raise grpc.aio.AioRpcError(
                exc.code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=exc.details
            ) from None

    async def cluster_state(self, timeout_s: float = 5.0) -> pb.ClusterState:
        return await self._service.GetClusterState(pb.ClusterStateRequest(), None)
