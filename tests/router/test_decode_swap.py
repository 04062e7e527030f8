"""A decode worker that dies before it streamed anything is swapped for another one, and the swap
never reuses the KV handle: the dead worker may have pulled the KV already (a pull tells the
prefill worker to free and reuse those blocks), so a second pull could read another request's KV.
The new worker gets the prompt plus the first token, one token less to generate and the prefill's
seed (the same output as one engine), and the held KV is released. Fakes stand in for the workers:
this is the router's logic over real gRPC and a real Redis."""

from __future__ import annotations

import asyncio

import grpc
from fake_decode_worker import FakeDecodeWorker, until

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from proto.call_stream import MultiplexedDecode, MultiplexedPrefill
from registry.cluster_view import ClusterView
from registry.registration import WorkerRegistration
from registry.schema import WorkerRecord, connect
from router.router import Router
from router.service import serve

PROMPT = list(range(1, 20))
FIRST_TOKEN, SEED = 77, 1234


class HandingPrefillWorker(MultiplexedPrefill, pb_grpc.PrefillWorkerServicer):
    """Answers Prefill with a KV handle (first token, seed); records Release calls."""

    def __init__(self) -> None:
        self.released: list[str] = []
        self.address = ""

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        return pb.PrefillResponse(
            handle=pb.KVHandle(
                request_id=request.request_id,
                worker_id="p0",
                epoch=1,
                agent_name="p0-1",
                block_ids=[0, 1, 2, 3, 4],
                num_tokens=len(request.prompt_token_ids),
                first_token=FIRST_TOKEN,
                seed=SEED,
                address=self.address,
            )
        )

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        self.released.append(request.request_id)
        return pb.ReleaseResponse(released=True)


class DyingDecodeWorker(MultiplexedDecode, pb_grpc.DecodeWorkerServicer):
    """Takes the Decode call (as if it pulled the KV), then its process dies before streaming."""

    def __init__(self) -> None:
        self.got: list[pb.DecodeRequest] = []
        self.server: grpc.aio.Server | None = None

    async def Decode(self, request: pb.DecodeRequest, context):
        self.got.append(request)
        await self.server.stop(0)  # the connection drops: UNAVAILABLE at the router
        await asyncio.Event().wait()
        yield pb.GenerateResponse()  # never reached


async def _start(servicer, add, wid: str, role: str, redis_url: str, free_blocks: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    add(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    servicer.address = address
    record = WorkerRecord(
        worker_id=wid,
        role=role,
        address=address,
        epoch=1,
        block_size=4,
        num_blocks=100,
        num_free_blocks=free_blocks,
    )
    WorkerRegistration(connect(redis_url), record, ttl_s=120).register([])
    return server


def test_swapped_decode_worker_recomputes_instead_of_reusing_the_handle(redis_server):
    async def main() -> None:
        url = redis_server.url
        view = ClusterView(url, poll_s=0.05)
        view.start()
        prefill, dying, healthy = (
            HandingPrefillWorker(),
            DyingDecodeWorker(),
            FakeDecodeWorker("d1", max_tokens=5),
        )
        servers = [
            await _start(prefill, pb_grpc.add_PrefillWorkerServicer_to_server, "p0", "prefill", url, 100)
        ]
        # d0 has the most free blocks: the policy picks it first.
        dying.server = await _start(
            dying, pb_grpc.add_DecodeWorkerServicer_to_server, "d0", "decode", url, 100
        )
        await healthy.start(url, free_blocks=10)
        router = Router(view)
        server, address = await serve(router)
        channel = grpc.aio.insecure_channel(address)
        try:
            await until(lambda: len(view.live_workers()) == 3, "the view lists p0, d0 and d1")
            params = pb.SamplingParams(max_tokens=6, ignore_eos=True)
            req = pb.GenerateRequest(request_id="r", prompt_token_ids=PROMPT, params=params)
            msgs = [m async for m in pb_grpc.RouterStub(channel).Generate(req, timeout=30)]

            assert len(dying.got) == 1 and dying.got[0].HasField("handle")  # the first try pulled
            (swapped_id,) = healthy.served
            assert swapped_id == "r"
            got = healthy.requests[0]
            assert not got.HasField("handle"), "the swap reused a KV handle another worker may have pulled"
            assert list(got.prompt_token_ids) == [*PROMPT, FIRST_TOKEN]
            assert got.params.max_tokens == 5 and got.params.seed == SEED
            await until(lambda: prefill.released == ["r"], "the held KV was released")
            tokens = [t for m in msgs for t in m.tokens.token_ids]
            assert tokens[0] == FIRST_TOKEN and len(tokens) == 6
            assert router.stats.decode_retries == 1
        finally:
            await channel.close()
            await server.stop(0)
            await router.close()
            for s in servers:
                await s.stop(0)
            await healthy.stop()
            view.stop()

    asyncio.run(main())


class UnsatisfiablePrefillWorker(MultiplexedPrefill, pb_grpc.PrefillWorkerServicer):
    """Refuses every request as the engine does one it cannot satisfy (a grammar that allows none of
    the model's tokens): FAILED_PRECONDITION, the request's own fault."""

    def __init__(self) -> None:
        self.calls = 0
        self.address = ""

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        self.calls += 1
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION, "the grammar allows none of the model's tokens"
        )


def test_a_request_level_failure_is_never_retried_elsewhere(redis_server):
    async def main() -> None:
        url = redis_server.url
        view = ClusterView(url, poll_s=0.05)
        view.start()
        prefills = [UnsatisfiablePrefillWorker(), UnsatisfiablePrefillWorker()]
        servers = [
            await _start(p, pb_grpc.add_PrefillWorkerServicer_to_server, f"p{i}", "prefill", url, 100)
            for i, p in enumerate(prefills)
        ]
        decode = FakeDecodeWorker("d0", max_tokens=4)
        await decode.start(url)
        router = Router(view)
        server, address = await serve(router)
        channel = grpc.aio.insecure_channel(address)
        try:
            await until(lambda: len(view.live_workers()) == 3, "the view lists p0, p1 and d0")
            params = pb.SamplingParams(max_tokens=4)
            req = pb.GenerateRequest(request_id="r", prompt_token_ids=PROMPT, params=params)
            try:
                _ = [m async for m in pb_grpc.RouterStub(channel).Generate(req, timeout=30)]
                raise AssertionError("the request should have failed")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "grammar" in exc.details()
            assert sum(p.calls for p in prefills) == 1  # not retried on the other prefill worker
            assert decode.served == []  # nor run aggregated on the decode worker
            assert router.stats.prefill_retries == 0 and router.stats.aggregated_fallbacks == 0
        finally:
            await channel.close()
            await server.stop(0)
            await router.close()
            for s in servers:
                await s.stop(0)
            await decode.stop()
            view.stop()

    asyncio.run(main())
