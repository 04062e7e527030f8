"""Stopping a request through the router: ``Router.Abort`` reaches the decode worker serving it, and a
caller that cancels its stream cancels the decode stream under it. The router's gRPC service runs
for real over a real Redis; the decode workers are fakes (``fake_decode_worker``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest
from fake_decode_worker import FakeDecodeWorker, until

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from registry.cluster_view import ClusterView
from router.router import Router
from router.service import serve

PARAMS = pb.SamplingParams(max_tokens=4096, ignore_eos=True)


@pytest.fixture
def view(redis_server):
    v = ClusterView(redis_server.url, poll_s=0.05)
    v.start()
    yield v
    v.stop()


@asynccontextmanager
async def router_over_fakes(
    view: ClusterView, redis_url: str, dead: tuple[str, ...] = ()
) -> AsyncIterator[tuple[Router, pb_grpc.RouterStub, list[FakeDecodeWorker]]]:
    """The router's service over decode workers d0 and d1, plus ``dead`` ones: registered, gone
    (their record not expired yet) and with fewer free blocks, so nothing is routed to them."""
    workers = [FakeDecodeWorker("d0"), FakeDecodeWorker("d1")]
    router = Router(view)
    server = channel = None
    try:
        for w in workers:
            await w.start(redis_url)
        for wid in dead:
            gone = FakeDecodeWorker(wid)
            await gone.start(redis_url, free_blocks=10)
            await gone.stop()
        ids = {w.worker_id for w in workers} | set(dead)
        await until(
            lambda: {w.worker_id for w in view.live_workers("decode")} == ids,
            f"the router's view lists {sorted(ids)}",
        )
        server, address = await serve(router)
        channel = grpc.aio.insecure_channel(address)
        yield router, pb_grpc.RouterStub(channel), workers
    finally:
        if channel is not None:
            await channel.close()
        if server is not None:
            await server.stop(0)
        await router.close()
        for w in workers:
            await w.stop()


async def _read_to_end(call) -> list[pb.GenerateResponse]:
    out = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        out.append(msg)
    return out


def _serving(workers: list[FakeDecodeWorker], rid: str) -> FakeDecodeWorker:
    (serving,) = [w for w in workers if rid in w.served]
    return serving


def test_router_abort_reaches_the_decode_worker_serving_the_request(redis_server, view):
    async def main() -> None:
        async with router_over_fakes(view, redis_server.url) as (router, stub, workers):
            req = pb.GenerateRequest(request_id="r1", prompt_token_ids=list(range(1, 20)), params=PARAMS)
            call = stub.Generate(req, timeout=60)
            try:
                assert (await call.read()).HasField("tokens")  # decoding on one of the workers
                serving = _serving(workers, "r1")
                assert serving.running == ["r1"]

                resp = await stub.Abort(pb.AbortRequest(request_id="r1"), timeout=10)

                assert "r1" in serving.aborts, "the router did not forward the abort to the decode worker"
                assert resp.aborted
                rest = await asyncio.wait_for(_read_to_end(call), 10)
                assert rest[-1].finished.finish_reason == "abort"
                assert serving.running == [] and serving.cancelled == []
            finally:
                call.cancel()
            await until(lambda: router.active == 0, "the router's Generate stream ended")
            assert router.inflight[serving.worker_id].requests == 0
            # A request nobody runs: the router says so.
            resp = await stub.Abort(pb.AbortRequest(request_id="unknown"), timeout=10)
            assert not resp.aborted

    asyncio.run(main())


def test_router_abort_gets_past_an_unreachable_decode_worker(redis_server, view):
    async def main() -> None:
        async with router_over_fakes(view, redis_server.url, dead=("d-gone",)) as (router, stub, workers):
            # NOTE: "d-gone" sorts first: the router asks it before the worker serving the request.
            req = pb.GenerateRequest(request_id="r3", prompt_token_ids=list(range(1, 20)), params=PARAMS)
            call = stub.Generate(req, timeout=60)
            try:
                assert (await call.read()).HasField("tokens")
                serving = _serving(workers, "r3")
                resp = await stub.Abort(pb.AbortRequest(request_id="r3"), timeout=10)
                assert resp.aborted and "r3" in serving.aborts
                rest = await asyncio.wait_for(_read_to_end(call), 10)
                assert rest[-1].finished.finish_reason == "abort"
            finally:
                call.cancel()
            await until(lambda: router.active == 0, "the router's Generate stream ended")

    asyncio.run(main())


def test_a_cancelled_caller_cancels_the_decode_stream(redis_server, view):
    async def main() -> None:
        async with router_over_fakes(view, redis_server.url) as (router, stub, workers):
            req = pb.GenerateRequest(request_id="r2", prompt_token_ids=list(range(1, 20)), params=PARAMS)
            call = stub.Generate(req, timeout=60)
            assert (await call.read()).HasField("tokens")
            serving = _serving(workers, "r2")

            call.cancel()  # the client went away

            await until(lambda: "r2" in serving.cancelled, f"{serving.worker_id} saw its stream cancelled")
            await until(lambda: router.active == 0, "the router's Generate stream ended")
            assert serving.running == [] and router.inflight[serving.worker_id].requests == 0

    asyncio.run(main())
