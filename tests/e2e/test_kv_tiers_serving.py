"""KV cache tiers served: prefill workers whose KV pool holds one tenant's prefix at a time keep the
others in their host tier, the router's index learns that through Redis, and the cache-aware route
sends each tenant back to the worker holding its prefix there (worker processes, real Redis, real
gRPC and NIXL). Output equals HF; every block is back in its pool."""

from __future__ import annotations

import asyncio
import random
import time

from pd_client import state
from test_router import Cluster

from engine.block_hash import hash_blocks
from router.affinity import RoutedPrefixes

BS = 8
PREFIX = 80  # tokens of a tenant's system prompt: 10 blocks, of a prefill pool of 16


def test_tenants_return_to_the_worker_holding_their_prefix_in_its_host_tier(
    workers, redis_server, tiny_llama, hf_greedy
):
    cluster = Cluster(
        workers, redis_server, num_prefill=2, kv_flags=("--kv-host-cache-gib", "0.01"), num_blocks=16
    )
    # Route from the index alone: the router's own record of what it just routed ends with each
    # prefill (no grace period), so only the workers' KV events can send a tenant back.
    cluster.router.routed = RoutedPrefixes(grace_s=0.0)
    rng = random.Random(3)
    systems = [[rng.randrange(3, 1000) for _ in range(PREFIX)] for _ in range(4)]

    async def indexed(worker: str, prompt: list[int]) -> None:
        """Until the router's index shows the prompt's prefix on ``worker`` (in either tier)."""
        want = PREFIX // BS
        deadline = time.monotonic() + 20
        while True:
            with cluster.view.index.lock:
                runs = cluster.view.index.match_tiers(hash_blocks(prompt, BS), [worker])[worker]
            if sum(runs) >= want:
                return
            assert time.monotonic() < deadline, (worker, runs)
            await asyncio.sleep(0.05)

    async def body():
        owner: dict[int, str] = {}
        for round_ in range(2):
            for t, system in enumerate(systems):
                prompt = system + [rng.randrange(3, 1000) for _ in range(5)]
                rid = f"t{t}-r{round_}"
                assert await cluster.generate(rid, prompt) == hf_greedy(tiny_llama, prompt, 6), rid
                route = cluster.routes[rid]
                assert route.predicted_hit_tokens == route.delivered_hit_tokens, (rid, route)
                if round_:
                    assert route.prefill_worker == owner[t], (rid, route, owner)
                    assert route.delivered_hit_tokens == PREFIX, (rid, route)
                owner.setdefault(t, route.prefill_worker)
                await indexed(owner[t], prompt)
        assert set(owner.values()) == {"p0", "p1"}  # two tenants each: more than a pool holds
        prefills = [await state(p.address, "prefill") for p in cluster.prefills]
        assert all(s.stats.prefix_cache_hits_host > 0 for s in prefills), [s.stats for s in prefills]
        await cluster.all_free()

    async def run():
        await cluster.start()
        try:
            await body()
        finally:
            await cluster.stop()

    asyncio.run(run())
