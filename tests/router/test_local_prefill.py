"""Conditional disaggregation: a prompt whose part the decode worker has not cached is short (at most
``local_prefill_tokens``) is prefilled on the decode worker itself, with no prefill call and no KV
handle; a longer one still goes through a prefill worker; 0 always disaggregates. Counted in the
router's stats. Fakes stand in for the workers: the router's logic over real gRPC and a real Redis."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from fake_decode_worker import FakeDecodeWorker, until
from test_decode_swap import HandingPrefillWorker, _start

from engine.block_hash import hash_blocks
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from registry.cluster_view import ClusterView
from registry.registration import WorkerRegistration
from registry.schema import WorkerRecord, connect
from router.router import Router
from router.service import serve

BS = 4
THRESHOLD = 8


class CountingPrefill(HandingPrefillWorker):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    async def Prefill(self, request, context):
        self.calls.append(request.request_id)
        return await super().Prefill(request, context)


@pytest.mark.parametrize("threshold", [THRESHOLD, 0])
def test_short_uncached_prompts_are_prefilled_on_the_decode_worker(redis_server, threshold):
    async def main() -> None:
        url = redis_server.url
        view = ClusterView(url, poll_s=0.05)
        view.start()
        prefill, decode = CountingPrefill(), FakeDecodeWorker("d0", max_tokens=3)
        p_server = await _start(
            prefill, pb_grpc.add_PrefillWorkerServicer_to_server, "p0", "prefill", url, 100
        )
        await decode.start(url)
        # The decode worker holds the blocks of a 40-token prefix (as its KV events would say).
        cached = list(range(100, 140))
        reg = WorkerRegistration(
            connect(url),
            WorkerRecord(worker_id="d0", role="decode", address=decode.address, epoch=2, block_size=BS),
        )
        reg.register(hash_blocks(cached, BS))
        router = Router(view, local_prefill_tokens=threshold)
        server, address = await serve(router)
        channel = grpc.aio.insecure_channel(address)
        stub = pb_grpc.RouterStub(channel)

        async def generate(rid: str, prompt: list[int]) -> list[int]:
            req = pb.GenerateRequest(
                request_id=rid,
                prompt_token_ids=prompt,
                params=pb.SamplingParams(max_tokens=3, ignore_eos=True),
            )
            return [t async for m in stub.Generate(req, timeout=30) for t in m.tokens.token_ids]

        try:
            await until(
                lambda: len(view.live_workers()) == 2 and len(view.index.blocks_of("d0")) == 10,
                "the view lists p0 and d0 and knows d0's cached prefix",
            )
            short = list(range(1, 1 + THRESHOLD))  # short in itself
            warm = [*cached, 7, 8, 9]  # 43 tokens, 3 of them not cached on d0
            cold = list(range(500, 543))  # 43 tokens, none cached
            for rid, prompt in (("short", short), ("warm", warm), ("cold", cold)):
                assert await generate(rid, prompt)  # (the fake decode worker streams 3 tokens)

            by_id = {r.request_id: r for r in decode.requests}
            if threshold:
                assert prefill.calls == ["cold"]
                assert not by_id["short"].HasField("handle") and not by_id["warm"].HasField("handle")
                assert by_id["cold"].HasField("handle")
                assert router.stats.local_prefills == 2
            else:
                assert prefill.calls == ["short", "warm", "cold"]
                assert all(r.HasField("handle") for r in decode.requests)
                assert router.stats.local_prefills == 0
            state = await stub.GetClusterState(pb.ClusterStateRequest(), timeout=10)
            assert state.local_prefills == router.stats.local_prefills
        finally:
            await channel.close()
            await server.stop(0)
            await router.close()
            await p_server.stop(0)
            await decode.stop()
            view.stop()

    asyncio.run(main())
