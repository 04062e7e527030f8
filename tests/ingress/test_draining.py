"""The front end while the application drains (``pdserve serve`` stopping, ``set_draining``): the
health probe says ``draining`` with a 503, so a load balancer stops sending traffic, and a request
the router refuses for it is a 503 coded ``draining``, as the front end's own refusal once it closes."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from asgi_client import call

from ingress.model_info import load_model_info
from ingress.options import IngressOptions
from ingress.server import Ingress
from proto import pdserve_pb2 as pb
from router.policies import DRAINING_MESSAGE


class DrainingRouter:
    """A router whose application drains: its cluster state says so and it refuses every request."""

    def __init__(self, draining: bool) -> None:
        self.draining = draining

    async def cluster_state(self, timeout_s: float = 5.0) -> pb.ClusterState:
        decode = pb.WorkerSummary(state=pb.WorkerState(role="decode"))
        return pb.ClusterState(workers=[decode], draining=self.draining)

    async def generate(self, rid, prompt, params, priority, timeout_s):
        if self.draining:
            empty = grpc.aio.Metadata()
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, empty, empty, details=DRAINING_MESSAGE)
        yield pb.GenerateResponse(finished=pb.Finished(finish_reason="length"))


@pytest.fixture(scope="module")
def info(tiny_llama):
    return load_model_info(str(tiny_llama), "tiny", None, tiny=True)


def test_health_is_a_503_saying_draining_while_the_application_drains(info):
    async def main(draining: bool):
        ingress = Ingress(info, IngressOptions(), DrainingRouter(draining), None, expect_prefill=False)
        r = await call(ingress.http, "/health")
        return r.status, r.json()["status"]

    assert asyncio.run(main(False)) == (200, "ok")
    assert asyncio.run(main(True)) == (503, "draining")


@pytest.mark.parametrize(("draining", "status"), [(False, 200), (True, 503)])
def test_a_head_probe_of_health_gets_the_same_status(info, draining, status):
    async def main():
        ingress = Ingress(info, IngressOptions(), DrainingRouter(draining), None, expect_prefill=False)
        return (await call(ingress.http, "/health", method="HEAD")).status

    assert asyncio.run(main()) == status


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_refused_while_the_application_drains_is_coded_draining(info, stream):
    async def main():
        ingress = Ingress(info, IngressOptions(), DrainingRouter(True), None, expect_prefill=False)
        body = {"model": "tiny", "prompt": "the world", "max_tokens": 3, "stream": stream}
        return await call(ingress.http, "/v1/completions", body)

    r = asyncio.run(main())
    assert r.status == 503
    err = r.json()["error"]
    assert err["code"] == "draining" and err["type"] == "service_unavailable"
    assert err["message"] == DRAINING_MESSAGE
