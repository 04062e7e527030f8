"""A disaggregated stack in this process for the router's tests: real prefill and decode workers (real
engines on the tiny model, their KV moved by the in-process fabric), registered in a real Redis and
served over real gRPC, with the router's gRPC service in front."""

from __future__ import annotations

import grpc
from fake_decode_worker import until

from decode_worker.service import serve as serve_decode
from decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from engine import EngineConfig
from kv_transfer import InProcessFabric
from prefill_worker.service import serve as serve_prefill
from prefill_worker.worker import PrefillWorker, PrefillWorkerConfig
from proto import pdserve_pb2_grpc as pb_grpc
from registry.cluster_view import ClusterView
from router.migration import MigrationOptions
from router.router import Router
from router.service import serve

NUM_BLOCKS = 128
BLOCK_SIZE = 4


class PDStack:
    def __init__(self, redis_url: str, model) -> None:
        self.view = ClusterView(redis_url, poll_s=0.05)
        self.router = Router(self.view, migration=MigrationOptions(stall_floor_s=2.0))
        fabric = InProcessFabric()

        def engine() -> EngineConfig:
            return EngineConfig(model=str(model), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)

        # Leases far longer than any test: KV that comes back was released, not expired.
        self.prefill = PrefillWorker(
            PrefillWorkerConfig(engine(), worker_id="p0", redis_url=redis_url, lease_seconds=600.0),
            fabric.transfer_factory,
        )
        self.decode = DecodeWorker(
            DecodeWorkerConfig(engine(), worker_id="d0", redis_url=redis_url, keepalive_s=0.1),
            transfer_factory=fabric.transfer_factory,
        )

    async def __aenter__(self) -> PDStack:
        self.view.start()
        await serve_prefill(self.prefill)
        await serve_decode(self.decode)
        await until(lambda: len(self.view.live_workers()) == 2, "both workers registered", timeout=30)
        self.server, address = await serve(self.router)
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.RouterStub(self.channel)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()
        await self.server.stop(0)
        await self.router.close()
        for w in (self.decode, self.prefill):
            await w.shutdown(0)
        self.view.stop()

    def all_free(self) -> bool:
        """Every worker idle, all its KV blocks free."""
        for w in (self.prefill, self.decode):
            if w.core.has_unfinished() or w.core.stats().num_free_blocks != w.core.kv.num_blocks:
                return False
        return True

    async def until_all_free(self, what: str) -> None:
        await until(self.all_free, what, timeout=15)
