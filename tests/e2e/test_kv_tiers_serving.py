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
from router.policies import WorkerLoad

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
    # What is checked here is each tenant going back to the worker holding it; reading it from there
    # to another worker instead is the next test's subject.
    cluster.router.policy.peer_reads = False
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


def test_a_prefix_held_by_a_busy_worker_is_read_by_another_over_nixl(
    workers, redis_server, tiny_llama, hf_greedy
):
    """Issue 33 item 3 across processes: p0 (engine in the worker's process) computes a tenant's
    prompt; with p0 busy, the router sends the tenant's next prompt to p1 (engine in its own process)
    with p0 as the peer to read the prefix from. p1 asks p0 to lend the blocks (gRPC), reads them
    host tier to host tier over NIXL and serves them as host hits: output equals HF, the hit is what
    the route predicted, p0's lease ends with the read, every block is back."""
    cluster = Cluster(
        workers,
        redis_server,
        num_prefill=2,
        kv_flags=("--kv-host-cache-gib", "0.01"),
        prefill_flags=((), ("--engine-process",)),
    )
    rng = random.Random(5)
    tenant = [rng.randrange(3, 1000) for _ in range(PREFIX)]
    other = [rng.randrange(3, 1000) for _ in range(PREFIX)]

    def busy(worker: str | None) -> None:
        """The router counts 10k tokens queued on ``worker`` (none: no extra load anywhere)."""
        cluster.router.inflight.clear()
        if worker is not None:
            cluster.router.inflight[worker] = WorkerLoad(prompt_tokens=10_000)

    async def until(check, what: str) -> None:
        deadline = time.monotonic() + 20
        while not check():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.05)

    def record(worker: str):
        return next(w for w in cluster.view.live_workers("prefill") if w.worker_id == worker)

    async def body():
        busy("p1")
        first = [*tenant, 7, 8, 9]
        assert await cluster.generate("a", first) == hf_greedy(tiny_llama, first, 6)
        assert cluster.routes["a"].prefill_worker == "p0"
        busy("p0")
        warm = [*other, 1]
        assert await cluster.generate("b", warm) == hf_greedy(tiny_llama, warm, 6)
        assert cluster.routes["b"].prefill_worker == "p1"  # p1 has measured a prefill: it can cost reads
        with cluster.view.index.lock:
            held = lambda: sum(cluster.view.index.match_tiers(hash_blocks(tenant, BS), ["p0"])["p0"])  # noqa: E731
        await until(lambda: held() == PREFIX // BS, "the index never showed p0's blocks")
        await until(lambda: record("p1").peer_hit_cost_pct < 100, "p1 never reported a peer-read cost")
        second = [*tenant, 4, 5, 6, 10, 11]
        assert await cluster.generate("c", second) == hf_greedy(tiny_llama, second, 6)
        route = cluster.routes["c"]
        assert (route.prefill_worker, route.peer_worker) == ("p1", "p0"), route
        assert route.delivered_hit_tokens == route.predicted_hit_tokens == PREFIX, route
        p0, p1 = [await state(p.address, "prefill") for p in cluster.prefills]
        assert p0.stats.peer_lent_blocks == PREFIX // BS
        assert p1.stats.peer_received_blocks == PREFIX // BS and p1.stats.prefix_cache_hits_host == PREFIX
        assert cluster.router.stats.peer_reads == 1
        busy(None)
        await cluster.all_free()

    async def run():
        await cluster.start()
        try:
            await body()
        finally:
            await cluster.stop()

    asyncio.run(run())


def test_aggregated_a_decode_worker_reads_a_busy_peers_prefix_over_nixl(
    workers, redis_server, tiny_llama, hf_greedy
):
    """Issue 33 item 3, aggregated (no prefill workers): d0 (engine in the worker's process) computes
    a tenant's prompt; with d0 busy, the router sends the tenant's next prompt to d1 (engine in its
    own process) with d0 as the peer. d1 asks d0 to lend the blocks (DecodeWorker.Lend), reads them
    host tier to host tier over NIXL and serves them as host hits: output equals HF, d0's lease ends
    with the read, every block is back."""
    cluster = Cluster(
        workers,
        redis_server,
        num_prefill=0,
        num_decode=2,
        kv_flags=("--kv-host-cache-gib", "0.01"),
        decode_flags=((), ("--engine-process",)),
    )
    rng = random.Random(6)
    tenant = [rng.randrange(3, 1000) for _ in range(PREFIX)]
    other = [rng.randrange(3, 1000) for _ in range(PREFIX)]

    def busy(worker: str | None) -> None:
        """The router counts 10k tokens queued on ``worker`` (none: no extra load anywhere)."""
        cluster.router.inflight.clear()
        if worker is not None:
            cluster.router.inflight[worker] = WorkerLoad(prompt_tokens=10_000)

    async def until(check, what: str) -> None:
        deadline = time.monotonic() + 20
        while not check():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.05)

    def record(worker: str):
        return next(w for w in cluster.view.live_workers("decode") if w.worker_id == worker)

    decisions = cluster.router.decisions

    async def body():
        busy("d1")
        first = [*tenant, 7, 8, 9]
        assert await cluster.generate("a", first) == hf_greedy(tiny_llama, first, 6)
        assert decisions[("decode", "d0")] == 1
        busy("d0")
        warm = [*other, 1]
        assert await cluster.generate("b", warm) == hf_greedy(tiny_llama, warm, 6)
        assert decisions[("decode", "d1")] == 1  # d1 has measured a prefill: it can cost reads
        with cluster.view.index.lock:
            held = lambda: sum(cluster.view.index.match_tiers(hash_blocks(tenant, BS), ["d0"])["d0"])  # noqa: E731
        await until(lambda: held() == PREFIX // BS, "the index never showed d0's blocks")
        await until(lambda: record("d1").peer_hit_cost_pct < 100, "d1 never reported a peer-read cost")
        second = [*tenant, 4, 5, 6, 10, 11]
        assert await cluster.generate("c", second) == hf_greedy(tiny_llama, second, 6)
        assert decisions[("decode", "d1")] == 2
        assert cluster.router.stats.peer_reads == 1
        d0, d1 = [await state(d.address, "decode") for d in cluster.decodes]
        assert d0.stats.peer_lent_blocks == PREFIX // BS
        assert d1.stats.peer_received_blocks == PREFIX // BS
        assert d1.stats.prefix_cache_hits_host == PREFIX
        busy(None)
        await cluster.all_free()

    async def run():
        await cluster.start()
        try:
            await body()
        finally:
            await cluster.stop()

    asyncio.run(run())
