"""Real in-process prefill and decode workers, any number of each (real engines on the tiny model,
their KV moved by the in-process fabric), registered in a real Redis and served over real gRPC, with
the router's gRPC service in front."""

from __future__ import annotations

import grpc
from fake_decode_worker import until

from decode_worker.service import serve as serve_decode
from decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from engine import EngineConfig
from kv_transfer import InProcessFabric
from prefill_worker.service import serve as serve_prefill
from prefill_worker.worker import PrefillWorker, PrefillWorkerConfig
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from registry.cluster_view import ClusterView
from router.migration import MigrationOptions
from router.router import Router
from router.service import serve

NUM_BLOCKS = 128
BLOCK_SIZE = 4


class EngineStack:
    def __init__(self, redis_url: str, model, num_prefill=1, num_decode=1, router_kw=None, engine_kw=None):
        self.view = ClusterView(redis_url, poll_s=0.05)
        migration = MigrationOptions(stall_floor_s=2.0)
        self.router = Router(self.view, migration=migration, **(router_kw or {}))
        fabric = InProcessFabric()

        def engine() -> EngineConfig:
            return EngineConfig(
                model=str(model), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, **(engine_kw or {})
            )

        # Leases far longer than any test: KV that comes back was released, not expired.
        self.prefills = [
            PrefillWorker(
                PrefillWorkerConfig(engine(), worker_id=f"p{i}", redis_url=redis_url, lease_seconds=600.0),
                fabric.transfer_factory,
            )
            for i in range(num_prefill)
        ]
        self.decodes = [
            DecodeWorker(
                DecodeWorkerConfig(engine(), worker_id=f"d{i}", redis_url=redis_url, keepalive_s=0.1),
                transfer_factory=fabric.transfer_factory,
            )
            for i in range(num_decode)
        ]

    @property
    def workers(self) -> list:
        return [*self.prefills, *self.decodes]

    @property
    def prefill(self) -> PrefillWorker:
        return self.prefills[0]

    @property
    def decode(self) -> DecodeWorker:
        return self.decodes[0]

    async def __aenter__(self) -> EngineStack:
        self.view.start()
        for p in self.prefills:
            await serve_prefill(p)
        for d in self.decodes:
            await serve_decode(d)
        n = len(self.workers)
        await until(lambda: len(self.view.live_workers()) == n, "every worker registered", timeout=30)
        self.server, address = await serve(self.router)
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.RouterStub(self.channel)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()
        await self.server.stop(0)
        await self.router.close()
        for w in reversed(self.workers):
            await w.shutdown(0)
        self.view.stop()

    def all_free(self) -> bool:
        """Every worker idle, all its KV blocks free."""
        return all(
            not w.core.has_unfinished() and w.core.stats().num_free_blocks == w.core.kv.num_blocks
            for w in self.workers
        )

    async def until_all_free(self, what: str) -> None:
        await until(self.all_free, what, timeout=15)

    async def generate(self, rid: str, prompt: list[int], params: pb.SamplingParams) -> list:
        req = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, params=params)
        return [msg async for msg in self.stub.Generate(req, timeout=60)]
