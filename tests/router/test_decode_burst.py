"""A burst routed at once spreads over the decode workers. Every request of the burst is routed
before any prefill returns, so no Decode is open yet: the router counts a request on its decode
worker from the moment it routes it there (``DecodeHold``), not from when its Decode opens, or the
whole burst would pile onto the worker that wins the tie. Fakes stand in for the workers: the
router's logic over real gRPC and a real Redis."""

from __future__ import annotations

import asyncio

import grpc
from fake_decode_worker import FakeDecodeWorker, until
from test_decode_swap import PROMPT, HandingPrefillWorker, _start

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from registry.cluster_view import ClusterView
from router.router import Router
from router.service import serve

BURST = 6


class GatedPrefillWorker(HandingPrefillWorker):
    """Holds every Prefill until the test opens the gate; counts those waiting."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.waiting = 0

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        self.waiting += 1
        await self.gate.wait()
        return await super().Prefill(request, context)


def test_a_burst_routed_before_any_prefill_returns_spreads_over_the_decode_workers(redis_server):
    async def main() -> None:
        url = redis_server.url
        view = ClusterView(url, poll_s=0.05)
        view.start()
        prefill = GatedPrefillWorker()
        p_server = await _start(
            prefill, pb_grpc.add_PrefillWorkerServicer_to_server, "p0", "prefill", url, 100
        )
        decodes = [FakeDecodeWorker(f"d{i}", max_tokens=3) for i in range(2)]
        for d in decodes:
            await d.start(url)
        router = Router(view)
        server, address = await serve(router)
        channel = grpc.aio.insecure_channel(address)
        stub = pb_grpc.RouterStub(channel)

        async def generate(i: int) -> None:
            params = pb.SamplingParams(max_tokens=4, ignore_eos=True)
            req = pb.GenerateRequest(request_id=f"r{i}", prompt_token_ids=PROMPT[i:], params=params)
            async for _ in stub.Generate(req, timeout=30):
                pass

        try:
            await until(lambda: len(view.live_workers()) == 3, "the view lists every worker")
            burst = [asyncio.create_task(generate(i)) for i in range(BURST)]
            await until(lambda: prefill.waiting == BURST, "the whole burst waits in prefill")
            prefill.gate.set()
            await asyncio.gather(*burst)
            served = sorted(len(d.served) for d in decodes)
            assert served == [BURST // 2, BURST // 2], served
            # Every count is back to zero once the burst is done: nothing stays held.
            assert all(load.requests == 0 for load in router.inflight.values()), router.inflight
        finally:
            await channel.close()
            await server.stop(0)
            await router.close()
            await p_server.stop(0)
            for d in decodes:
                await d.stop()
            view.stop()

    asyncio.run(main())
