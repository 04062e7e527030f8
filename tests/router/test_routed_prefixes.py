"""The router records what it routes where, over real gRPC and a real Redis (fake workers that
publish no KV events, so the index never shows a prefix: whatever affinity appears is the router's
own record). A second request with the same prefix follows the first; a refused prefill leaves no
record behind."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
from fake_decode_worker import FakeDecodeWorker, until
from test_decode_swap import PROMPT, HandingPrefillWorker, _start

from engine.block_hash import hash_blocks
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from registry.cluster_view import ClusterView
from router.affinity import RoutedPrefixes
from router.router import Router
from router.service import serve


class RefusingPrefillWorker(HandingPrefillWorker):
    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "refused")


class Frozen:
    """A clock that does not move: records live until the test says so."""

    t = 0.0

    def __call__(self) -> float:
        return self.t


@contextlib.asynccontextmanager
async def _stack(
    url: str, prefills: dict[str, pb_grpc.PrefillWorkerServicer], clock: Frozen, decode_workers: int = 1
):
    """The router's gRPC service over these fake prefill workers and ``decode_workers`` fake decode
    workers; yields the router, a Generate caller, and once the view lists every worker."""
    view = ClusterView(url, poll_s=0.05)
    view.start()
    add = pb_grpc.add_PrefillWorkerServicer_to_server
    servers = [await _start(p, add, wid, "prefill", url, 100) for wid, p in prefills.items()]
    decodes = [FakeDecodeWorker(f"d{i}", max_tokens=3) for i in range(decode_workers)]
    for d in decodes:
        await d.start(url)
    router = Router(view)
    router.routed = RoutedPrefixes(grace_s=5.0, clock=clock)
    server, address = await serve(router)
    channel = grpc.aio.insecure_channel(address)
    stub = pb_grpc.RouterStub(channel)

    async def generate(rid: str, prompt: list[int]) -> None:
        params = pb.SamplingParams(max_tokens=4, ignore_eos=True)
        req = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, params=params)
        async for _ in stub.Generate(req, timeout=30):
            pass

    try:
        await until(
            lambda: len(view.live_workers()) == len(prefills) + decode_workers, "the view lists every worker"
        )
        yield router, generate
    finally:
        await channel.close()
        await server.stop(0)
        await router.close()
        for s in servers:
            await s.stop(0)
        for d in decodes:
            await d.stop()
        view.stop()


def test_routed_prefix_draws_the_next_request_until_the_grace_ends(redis_server):
    async def main() -> None:
        clock = Frozen()
        prefills = {"p0": HandingPrefillWorker(), "p1": HandingPrefillWorker()}
        async with _stack(redis_server.url, prefills, clock) as (router, generate):
            await generate("a", PROMPT)
            (first,) = [w for w, n in router.decisions.items() if w[0] == "prefill" and n]
            holders = router.routed.holders()
            hashes = hash_blocks(PROMPT, 4)
            assert all(set(holders[h]) == {first[1]} for h in hashes), "the routed prompt was not recorded"
            # Same prefix, another question: it follows the first to where its blocks are, though
            # that worker has some work queued and the other none (a tie would go to either).
            router.inflight[first[1]].prompt_tokens = 8
            await generate("b", [*PROMPT[:16], 900, 901, 902])
            assert router.decisions[first] == 2

            clock.t = 6.0  # past the grace: the record is gone (the index would show the truth)
            assert router.routed.holders() == {} and len(router.routed) == 0

    asyncio.run(main())


def test_refused_prefill_leaves_no_record(redis_server):
    async def main() -> None:
        async with _stack(redis_server.url, {"p0": RefusingPrefillWorker()}, Frozen()) as (router, generate):
            try:
                await generate("r", PROMPT)
                raise AssertionError("the refused prefill did not fail the request")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert router.decisions[("prefill", "p0")] == 1
            assert router.routed.holders() == {} and len(router.routed) == 0

    asyncio.run(main())


def test_aggregated_a_routed_prompt_draws_the_next_to_its_decode_worker(redis_server):
    """No prefill workers: the decode worker computes the prompt, so it is recorded there and its
    uncached tokens count on it until its first token. A second request with the same prefix
    follows it though that worker has some work queued and the other none; afterwards nothing is
    left counted."""

    async def main() -> None:
        async with _stack(redis_server.url, {}, Frozen(), decode_workers=2) as (router, generate):
            await generate("a", PROMPT)
            (first,) = [w for w, n in router.decisions.items() if n]
            hashes = hash_blocks(PROMPT, 4)
            assert all(set(router.routed.holders()[h]) == {first[1]} for h in hashes)
            # Busier by the tie-break too (a request running there): only the prefix draws it back.
            load = router.inflight[first[1]]
            load.prompt_tokens, load.requests = 8, 1
            await generate("b", [*PROMPT[:16], 900, 901, 902])
            assert router.decisions[first] == 2
            load.prompt_tokens, load.requests = 0, 0
            assert all((load.prompt_tokens, load.requests) == (0, 0) for load in router.inflight.values())

    asyncio.run(main())
