"""The front end's Generate calls over the router's call stream (``RouterClient``; each test over the
router's socket, ``proto.socket_stream``, and over its gRPC ``GenerateStream``), and the router's
Decode calls over each worker's ``DecodeStream``: many requests share one stream each way, each gets
its own tokens and end, a caller that leaves cancels its decode on the worker, and an Abort still
ends its stream with an ``abort`` finish. Real Redis, the router's real gRPC service, fake decode
workers."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from fake_decode_worker import FakeDecodeWorker, until
from test_abort import _serving, view  # noqa: F401  (view: a fixture)

from engine.sampling_params import SamplingParams
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from proto.socket_stream import SocketCall
from router.client import RouterClient
from router.router import Router
from router.service import serve

PROMPT = list(range(1, 20))


@contextlib.asynccontextmanager
async def _router(view, redis_url: str, max_tokens: int = 10_000, socket: bool = True):  # noqa: F811
    workers = [FakeDecodeWorker("d0", max_tokens=max_tokens), FakeDecodeWorker("d1", max_tokens=max_tokens)]
    router = Router(view)
    server = client = None
    try:
        for w in workers:
            await w.start(redis_url)
        await until(lambda: len(view.live_workers("decode")) == 2, "the router's view lists both workers")
        server, address = await serve(router, socket_streams=socket)

        async def resolve() -> str:
            return address

        client = RouterClient(resolve)
        yield router, client, workers, address
    finally:
        if client is not None:
            await client.close()
        if server is not None:
            await server.stop(0)
        await router.close()
        for w in workers:
            await w.stop()


@pytest.mark.parametrize("socket", [True, False], ids=["socket", "grpc"])
def test_many_requests_share_the_streams_and_each_gets_its_own_tokens(redis_server, view, socket):  # noqa: F811
    async def main() -> None:
        async with _router(view, redis_server.url, max_tokens=5, socket=socket) as (
            router,
            client,
            workers,
            _,
        ):

            async def one(i: int) -> list[pb.GenerateResponse]:
                params = SamplingParams(max_tokens=5, ignore_eos=True)
                return [m async for m in client.generate(f"r{i}", PROMPT, params, 0, 60)]

            outs = await asyncio.gather(*(one(i) for i in range(12)))
            for msgs in outs:
                tokens = [t for m in msgs if m.HasField("tokens") for t in m.tokens.token_ids]
                assert tokens == [0, 1, 2, 3, 4]
                assert msgs[-1].finished.finish_reason == "length"
            assert sorted(rid for w in workers for rid in w.served) == sorted(f"r{i}" for i in range(12))
            # One stream from this client to the router, one from the router to each worker.
            assert client._calls._stream is not None and not client._calls._stream.broken
            assert isinstance(client._calls._stream._call, SocketCall) == socket
            assert set(router.stubs._streams) == {w.address for w in workers}
            await until(lambda: router.active == 0, "the router's streams ended")

    asyncio.run(main())


@pytest.mark.parametrize("socket", [True, False], ids=["socket", "grpc"])
def test_a_caller_that_leaves_cancels_its_decode_on_the_worker(redis_server, view, socket):  # noqa: F811
    async def main() -> None:
        async with _router(view, redis_server.url, socket=socket) as (router, client, workers, _):
            params = SamplingParams(max_tokens=4096, ignore_eos=True)
            stay = client.generate("stay", PROMPT, params, 0, 60)
            leave = client.generate("leave", PROMPT, params, 0, 60)
            assert (await anext(stay)).HasField("tokens") and (await anext(leave)).HasField("tokens")
            serving = _serving(workers, "leave")
            await leave.aclose()  # the HTTP client went away
            await until(lambda: "leave" in serving.cancelled, "the worker saw its decode cancelled")
            assert (await anext(stay)).HasField("tokens")  # the other call on the streams goes on
            await stay.aclose()
            await until(lambda: router.active == 0, "the router's streams ended")
            assert all(load.requests == 0 for load in router.inflight.values())

    asyncio.run(main())


@pytest.mark.parametrize("socket", [True, False], ids=["socket", "grpc"])
def test_abort_over_grpc_ends_the_streamed_call(redis_server, view, socket):  # noqa: F811
    async def main() -> None:
        async with _router(view, redis_server.url, socket=socket) as (_, client, workers, address):
            params = SamplingParams(max_tokens=4096, ignore_eos=True)
            stream = client.generate("r1", PROMPT, params, 0, 60)
            assert (await anext(stream)).HasField("tokens")
            rest = asyncio.ensure_future(_drain(stream))
            async with grpc.aio.insecure_channel(address) as channel:
                resp = await pb_grpc.RouterStub(channel).Abort(pb.AbortRequest(request_id="r1"), timeout=10)
            assert resp.aborted and "r1" in _serving(workers, "r1").aborts
            msgs = await asyncio.wait_for(rest, 10)
            assert msgs[-1].finished.finish_reason == "abort"

    asyncio.run(main())


async def _drain(stream) -> list[pb.GenerateResponse]:
    return [m async for m in stream]
