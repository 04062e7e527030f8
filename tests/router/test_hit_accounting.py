"""The router's prefix-hit counters (``pdserve_router_*_hit_tokens_total``) on real engines: every
route's predicted hits and every computing worker's delivered ones count, wherever the prompt was
computed; a request the engine takes no hits for (``prompt_logprobs``) is predicted none."""

from __future__ import annotations

import asyncio

from engine_stack import EngineStack
from fake_decode_worker import until

from proto import pdserve_pb2 as pb

PROMPT = list(range(3, 44))  # 41 tokens, blocks of 4: 10 blocks (40 tokens) can be hits


def params(**kw) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, **kw)


def cached_and_route(msgs) -> tuple[int, tuple[int, int] | None]:
    fin = [m.finished for m in msgs if m.WhichOneof("kind") == "finished"]
    route = [
        (m.route.predicted_hit_tokens, m.route.delivered_hit_tokens) for m in msgs if m.HasField("route")
    ]
    return fin[0].usage.cached_tokens, route[0] if route else None


def hits(s: EngineStack) -> tuple[int, int]:
    return s.router.stats.predicted_hit_tokens, s.router.stats.delivered_hit_tokens


async def indexed(s: EngineStack, blocks: int) -> None:
    idx = s.view.index
    await until(
        lambda: any(idx.num_blocks_of(w.worker_id) >= blocks for w in s.view.live_workers()),
        "the first prompt's KV events in the index",
    )


def test_aggregated_hits_count(redis_server, tiny_llama):
    async def main():
        async with EngineStack(redis_server.url, tiny_llama, num_prefill=0, num_decode=2) as s:
            await s.generate("a", PROMPT, params())
            await indexed(s, 10)
            second = await s.generate("b", PROMPT, params())
            assert cached_and_route(second) == (40, None)
            assert hits(s) == (40, 40), s.router.stats
            await s.until_all_free("every KV block free")

    asyncio.run(main())


def test_local_prefill_hits_count(redis_server, tiny_llama):
    async def main():
        kw = {"local_prefill_tokens": 8}
        async with EngineStack(redis_server.url, tiny_llama, router_kw=kw) as s:
            await s.generate("a", PROMPT, params())  # through the prefill worker: d0 pulls its KV
            await until(lambda: s.view.index.num_blocks_of("d0") >= 10, "d0's blocks in the index")
            second = await s.generate("b", [*PROMPT, 50, 51], params())  # 3 uncached: prefilled on d0
            assert s.router.stats.local_prefills == 1
            assert cached_and_route(second) == (40, None)
            assert hits(s) == (40, 40), s.router.stats
            await s.until_all_free("every KV block free")

    asyncio.run(main())


def test_prompt_logprobs_requests_are_predicted_no_hits(redis_server, tiny_llama):
    async def main():
        async with EngineStack(redis_server.url, tiny_llama, num_prefill=2) as s:
            await s.generate("a", PROMPT, params())
            await indexed(s, 10)
            assert cached_and_route(await s.generate("b", PROMPT, params())) == (40, (40, 40))
            third = await s.generate("c", PROMPT, params(prompt_logprobs=1))
            assert cached_and_route(third) == (0, (0, 0))
            assert hits(s) == (40, 40), s.router.stats
            await s.until_all_free("every KV block free")

    asyncio.run(main())


def test_no_hits_are_predicted_on_workers_that_cache_nothing(redis_server, tiny_llama):
    """Workers without prefix caching publish it, and the router neither records the prefixes it
    routes to them nor predicts hits there."""

    async def main():
        kw = {"enable_prefix_caching": False}
        async with EngineStack(redis_server.url, tiny_llama, num_prefill=2, engine_kw=kw) as s:
            assert all(not w.prefix_caching for w in s.view.live_workers())
            for i in range(4):
                msgs = await s.generate(f"r{i}", [*PROMPT, 100 + i, 200 + i], params())
                assert cached_and_route(msgs)[1] == (0, 0), i
            assert not s.router.routed.holders() and hits(s) == (0, 0)
            await s.until_all_free("every KV block free")

    asyncio.run(main())
