"""A worker that died (SIGKILL, node loss) stays in the cluster view until its record expires and the
view's grace passes (~20 s by default). The router finds it unreachable and routes that request
around it; it must also keep it out of routing for a while (a *suspect*, as a stalled worker is),
or it stays the policy's first choice (the router counts no requests in flight there: it looks
idle) and every request pays a failed first try there: for a decode worker, its prefilled KV
released unread and the prompt computed again. A replaced incarnation is not the one that died.
Fakes stand in for the workers, over real gRPC and a real Redis."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
from fake_decode_worker import FakeDecodeWorker, until
from test_decode_swap import PROMPT, HandingPrefillWorker, _start

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from registry.cluster_view import ClusterView
from registry.schema import WorkerRecord
from router.router import Router
from router.service import serve

PARAMS = pb.SamplingParams(max_tokens=6, ignore_eos=True)
REQUESTS = 6


async def _generate_all(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.RouterStub(channel)
        for i in range(REQUESTS):
            req = pb.GenerateRequest(request_id=f"r{i}", prompt_token_ids=PROMPT, params=PARAMS)
            msgs = [m async for m in stub.Generate(req, timeout=30)]
            assert msgs[-1].finished.finish_reason == "length"


def test_a_dead_decode_worker_is_tried_once_then_avoided(redis_server):
    async def main() -> None:
        url = redis_server.url
        view = ClusterView(url, poll_s=0.05)
        view.start()
        prefill = HandingPrefillWorker()
        p_server = await _start(
            prefill, pb_grpc.add_PrefillWorkerServicer_to_server, "p0", "prefill", url, 100
        )
        dead, healthy = FakeDecodeWorker("d0", max_tokens=5), FakeDecodeWorker("d1", max_tokens=5)
        await dead.start(url, free_blocks=100)  # the most free blocks: the policy's first choice
        await healthy.start(url, free_blocks=90)
        router = Router(view)
        server, address = await serve(router)
        try:
            await until(lambda: len(view.live_workers()) == 3, "the view lists p0, d0 and d1")
            await dead.stop()  # the process dies; its record lives on
            await _generate_all(address)
            assert router.decisions[("decode", "d0")] == 1, "the dead decode worker was routed to again"
            assert "d0" in router.suspects and router.stats.decode_retries == 1
            recomputed = [r for r in healthy.requests if not r.HasField("handle")]
            assert len(recomputed) == 1  # only the first request lost its prefilled KV
            await until(lambda: prefill.released == ["r0"], "the KV d0 never read was released")
        finally:
            await server.stop(0)
            await router.close()
            await p_server.stop(0)
            await healthy.stop()
            view.stop()

    asyncio.run(main())


def test_a_dead_prefill_worker_is_tried_once_then_avoided(redis_server):
    async def main() -> None:
        url = redis_server.url
        view = ClusterView(url, poll_s=0.05)
        view.start()
        dead, healthy = HandingPrefillWorker(), HandingPrefillWorker()
        add = pb_grpc.add_PrefillWorkerServicer_to_server
        dead_server = await _start(dead, add, "p0", "prefill", url, 100)
        p_server = await _start(healthy, add, "p1", "prefill", url, 100)
        decode = FakeDecodeWorker("d0", max_tokens=5)
        await decode.start(url)
        router = Router(view, "least_load")
        server, address = await serve(router)
        try:
            await until(lambda: len(view.live_workers()) == 3, "the view lists p0, p1 and d0")
            await dead_server.stop(0)  # the process dies; its record lives on
            await _generate_all(address)
            assert router.decisions[("prefill", "p0")] == 1, "the dead prefill worker was routed to again"
            assert "p0" in router.suspects and router.stats.prefill_retries == 1
            assert router.decisions[("prefill", "p1")] == REQUESTS and router.stats.aggregated_fallbacks == 0
        finally:
            await server.stop(0)
            await router.close()
            await p_server.stop(0)
            await decode.stop()
            view.stop()

    asyncio.run(main())


def test_an_unreachable_incarnation_that_was_replaced_does_not_make_its_id_suspect():
    old = WorkerRecord("d0", "decode", "127.0.0.1:1", epoch=1)
    router = Router(SimpleNamespace(workers={"d0": WorkerRecord("d0", "decode", "127.0.0.1:2", epoch=2)}))
    router.suspect_unreachable(old)  # the old process is gone; its id now names the replacement
    assert router.suspects == {}
    router.suspect_unreachable(WorkerRecord("d0", "decode", "127.0.0.1:2", epoch=2))
    assert "d0" in router.suspects
