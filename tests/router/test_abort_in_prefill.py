"""``Router.Abort`` of a request still in prefill: the prefill call under it is cancelled (the prefill
worker aborts the request or frees its held KV), nothing is decoded, and the caller's stream ends
with finish reason ``abort``."""

from __future__ import annotations

import asyncio

import grpc
from fake_decode_worker import FakeDecodeWorker, until

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from proto.call_stream import MultiplexedPrefill
from registry.cluster_view import ClusterView
from registry.registration import WorkerRegistration
from registry.schema import WorkerRecord, connect
from router.router import Router
from router.service import serve


class StuckPrefillWorker(MultiplexedPrefill, pb_grpc.PrefillWorkerServicer):
    """Accepts Prefill calls and never answers them; records the calls and their cancellation."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.cancelled: list[str] = []

    async def Prefill(self, request: pb.PrefillRequest, context):
        self.calls.append(request.request_id)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise

    async def start(self, redis_url: str) -> grpc.aio.Server:
        server = grpc.aio.server()
        pb_grpc.add_PrefillWorkerServicer_to_server(self, server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        record = WorkerRecord(
            worker_id="p0", role="prefill", address=address, epoch=1, block_size=4, num_blocks=100
        )
        WorkerRegistration(connect(redis_url), record, ttl_s=120).register([])
        return server


def test_abort_during_prefill_cancels_the_prefill_call(redis_server):
    async def main() -> None:
        view = ClusterView(redis_server.url, poll_s=0.05)
        view.start()
        prefill, decode = StuckPrefillWorker(), FakeDecodeWorker("d0")
        p_server = await prefill.start(redis_server.url)
        await decode.start(redis_server.url)
        router = Router(view)
        server, address = await serve(router)
        channel = grpc.aio.insecure_channel(address)
        try:
            await until(lambda: len(view.live_workers()) == 2, "the view lists p0 and d0")
            stub = pb_grpc.RouterStub(channel)
            req = pb.GenerateRequest(
                request_id="r", prompt_token_ids=list(range(1, 20)), params=pb.SamplingParams(max_tokens=8)
            )
            call = stub.Generate(req, timeout=60)
            await until(lambda: prefill.calls == ["r"], "the request is in prefill")

            assert (await stub.Abort(pb.AbortRequest(request_id="r"), timeout=10)).aborted

            await until(lambda: prefill.cancelled == ["r"], "the prefill call was cancelled")
            await until(lambda: router.active == 0, "the router's stream ended")
            msgs = [msg async for msg in call]  # the stream ends, and says why
            assert msgs[-1].finished.finish_reason == "abort"
            assert decode.served == []  # nothing went on to decode
        finally:
            await channel.close()
            await server.stop(0)
            await router.close()
            await p_server.stop(0)
            await decode.stop()
            view.stop()

    asyncio.run(main())
