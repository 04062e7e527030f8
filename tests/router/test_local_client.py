"""The router called in-process (``http_server: router``) behaves as it does over gRPC: ``Router.Abort``
ends the stream with an ``abort`` finish, a caller that goes away cancels the decode stream under
it, a router without workers fails with UNAVAILABLE as an ``AioRpcError``, and the cluster state is
the same router's. Real Redis and the router's real gRPC service (for Abort); fake decode workers."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from fake_decode_worker import until
from test_abort import _serving, router_over_fakes, view  # noqa: F401  (view: a fixture)

from engine.sampling_params import SamplingParams
from proto import pdserve_pb2 as pb
from registry.cluster_view import ClusterView
from router.local_client import LocalRouterClient
from router.router import Router

PARAMS = SamplingParams(max_tokens=4096, ignore_eos=True)
PROMPT = list(range(1, 20))


def test_abort_ends_the_local_stream_and_reaches_the_decode_worker(redis_server, view):  # noqa: F811
    async def main() -> None:
        async with router_over_fakes(view, redis_server.url) as (router, stub, workers):
            client = LocalRouterClient(router)
            stream = client.generate("r1", PROMPT, PARAMS, 0, 60)
            assert (await anext(stream)).HasField("tokens")
            serving = _serving(workers, "r1")

            # Router.Abort over gRPC cancels the in-process caller's task; its stream ends normally.
            async def read_rest() -> list[pb.GenerateResponse]:
                return [msg async for msg in stream]

            rest = asyncio.create_task(read_rest())
            await until(lambda: router.cancellation.tracks("r1"), "the stream is tracked")
            resp = await stub.Abort(pb.AbortRequest(request_id="r1"), timeout=10)
            assert resp.aborted and "r1" in serving.aborts
            msgs = await asyncio.wait_for(rest, 10)
            assert msgs[-1].finished.finish_reason == "abort"
            await until(lambda: router.active == 0, "the router's stream ended")
            state = await client.cluster_state()
            assert state.requests_routed == 1 and state.active_requests == 0
            assert {w.state.worker_id for w in state.workers} == {w.worker_id for w in workers}

    asyncio.run(main())


def test_a_caller_that_goes_away_cancels_the_decode_stream(redis_server, view):  # noqa: F811
    async def main() -> None:
        async with router_over_fakes(view, redis_server.url) as (router, _stub, workers):
            stream = LocalRouterClient(router).generate("r2", PROMPT, PARAMS, 0, 60)
            assert (await anext(stream)).HasField("tokens")
            serving = _serving(workers, "r2")
            await stream.aclose()  # the HTTP client went away
            await until(lambda: "r2" in serving.cancelled, f"{serving.worker_id} saw its stream cancelled")
            await until(lambda: router.active == 0, "the router's stream ended")
            assert router.inflight[serving.worker_id].requests == 0

    asyncio.run(main())


def test_no_workers_fails_as_unavailable(redis_server):
    async def main() -> None:
        empty = ClusterView(redis_server.url, poll_s=0.05)
        empty.start()
        router = Router(empty)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in LocalRouterClient(router).generate("r3", PROMPT, PARAMS, 0, 10):
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "worker" in err.value.details()
            assert router.stats.failed == 1 and router.stats.failed_by_code == {"UNAVAILABLE": 1}
        finally:
            await router.close()
            empty.stop()

    asyncio.run(main())
