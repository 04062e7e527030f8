"""The router's part of the hop timing: the Finished it relays carries the decode worker's timing,
the prefill worker's (from its PrefillResponse) and the router's own (routing decision, its
overhead, each worker call as it saw it); GetClusterState summarises the recent requests per hop.
Fakes stand in for the workers: the router's logic over real gRPC and a real Redis."""

from __future__ import annotations

import asyncio

import grpc
from fake_decode_worker import FakeDecodeWorker, until
from test_decode_swap import HandingPrefillWorker, _start

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from registry.cluster_view import ClusterView
from router.router import Router
from router.service import serve

WORKER_TIMING = {"kv_transfer_ms": 3.0, "decode_queue_ms": 4.0, "decode_first_step_ms": 5.0}
PREFILL_TIMING = {"prefill_queue_ms": 1.0, "prefill_compute_ms": 2.0}


class TimedPrefill(HandingPrefillWorker):
    async def Prefill(self, request, context):
        resp = await super().Prefill(request, context)
        resp.timing.CopyFrom(pb.HopTiming(**PREFILL_TIMING))
        return resp


class TimedDecode(FakeDecodeWorker):
    """Streams ``max_tokens`` tokens, its Finished stamped like a real decode worker's."""

    async def Decode(self, request, context):
        async for msg in super().Decode(request, context):
            if msg.HasField("finished"):
                msg.finished.timing.CopyFrom(pb.HopTiming(**WORKER_TIMING))
            yield msg


def _fields(t: pb.HopTiming) -> dict[str, float]:
    return {fd.name: v for fd, v in t.ListFields()}


def test_finished_carries_every_hops_timing_and_the_router_summarises_it(redis_server):
    async def main() -> None:
        url = redis_server.url
        view = ClusterView(url, poll_s=0.05)
        view.start()
        decode = TimedDecode("d0", interval_s=0.001, max_tokens=3)
        await decode.start(url)
        router = Router(view)
        server, address = await serve(router)
        channel = grpc.aio.insecure_channel(address)
        stub = pb_grpc.RouterStub(channel)
        p_server = None

        async def finished(rid: str) -> pb.Finished:
            req = pb.GenerateRequest(
                request_id=rid, prompt_token_ids=list(range(1, 20)), params=pb.SamplingParams(max_tokens=4)
            )
            msgs = [m async for m in stub.Generate(req, timeout=30)]
            return next(m.finished for m in msgs if m.HasField("finished"))

        try:
            await until(lambda: len(view.live_workers()) == 1, "the view lists d0")
            aggregated = _fields((await finished("agg")).timing)
            own = {"route_ms", "router_ms", "decode_call_ms"}
            assert set(aggregated) == own | set(WORKER_TIMING)
            assert all(aggregated[k] >= 0 for k in own)
            assert {k: aggregated[k] for k in WORKER_TIMING} == WORKER_TIMING

            p_server = await _start(
                TimedPrefill(), pb_grpc.add_PrefillWorkerServicer_to_server, "p0", "prefill", url, 100
            )
            await until(lambda: len(view.live_workers()) == 2, "the view lists p0 and d0")
            disagg = _fields((await finished("disagg")).timing)
            assert set(disagg) == own | {"prefill_call_ms"} | set(WORKER_TIMING) | set(PREFILL_TIMING)
            assert {k: disagg[k] for k in PREFILL_TIMING} == PREFILL_TIMING
            assert disagg["prefill_call_ms"] >= 0

            state = await stub.GetClusterState(pb.ClusterStateRequest(), timeout=10)
            summary = {h.hop: h for h in state.hop_timing}
            assert summary["route"].count == 2 and summary["prefill_call"].count == 1
            assert summary["prefill_queue"].mean_ms == summary["prefill_queue"].p90_ms == 1.0
            assert summary["kv_transfer"].count == 2 and summary["kv_transfer"].p50_ms == 3.0
        finally:
            await channel.close()
            await server.stop(0)
            await router.close()
            await decode.stop()
            if p_server is not None:
                await p_server.stop(0)
            view.stop()

    asyncio.run(main())
