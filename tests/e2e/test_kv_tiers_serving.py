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


async def _read_from_a_busy_owner(cluster, role: str, seed: int, want) -> None:
    """Workers ``<r>0`` and ``<r>1`` of ``role`` (r: its initial), both with host tiers. With the
    second busy, the first computes a tenant's prompt; with the first busy, the second computes
    another (so it has measured a prefill and can cost a read); once the index shows the first's
    blocks and the second a peer-read cost, the tenant's next prompt goes, the first still busy, to
    the second with the first as its peer. Every output equals ``want`` (HF); every block is back,
    then the two workers' states (owner, reader) are returned."""
    owner, reader = f"{role[0]}0", f"{role[0]}1"
    rng = random.Random(seed)
    tenant = [rng.randrange(3, 1000) for _ in range(PREFIX)]
    other = [rng.randrange(3, 1000) for _ in range(PREFIX)]
    decisions = cluster.router.decisions

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

    def peer_cost() -> int:
        return next(w for w in cluster.view.live_workers(role) if w.worker_id == reader).peer_hit_cost_pct

    def held() -> int:
        with cluster.view.index.lock:
            return sum(cluster.view.index.match_tiers(hash_blocks(tenant, BS), [owner])[owner])

    busy(reader)
    first = [*tenant, 7, 8, 9]
    assert await cluster.generate("a", first) == want(first)
    assert decisions[(role, owner)] == 1
    busy(owner)
    warm = [*other, 1]
    assert await cluster.generate("b", warm) == want(warm)
    assert decisions[(role, reader)] == 1
    await until(lambda: held() == PREFIX // BS, f"the index never showed {owner}'s blocks")
    await until(lambda: peer_cost() < 100, f"{reader} never reported a peer-read cost")
    second = [*tenant, 4, 5, 6, 10, 11]
    assert await cluster.generate("c", second) == want(second)
    assert decisions[(role, reader)] == 2
    assert cluster.router.stats.peer_reads == 1
    busy(None)
    await cluster.all_free()
    workers = cluster.prefills if role == "prefill" else cluster.decodes
    owner_state, reader_state = [await state(w.address, role) for w in workers]
    assert owner_state.stats.peer_lent_blocks == PREFIX // BS
    assert reader_state.stats.peer_received_blocks == PREFIX // BS
    assert reader_state.stats.prefix_cache_hits_host == PREFIX


def _run(cluster, body) -> None:
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

    async def body():
        await _read_from_a_busy_owner(cluster, "prefill", 5, lambda p: hf_greedy(tiny_llama, p, 6))
        route = cluster.routes["c"]
        assert (route.prefill_worker, route.peer_worker) == ("p1", "p0"), route
        assert route.delivered_hit_tokens == route.predicted_hit_tokens == PREFIX, route

    _run(cluster, body)


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
    _run(
        cluster, lambda: _read_from_a_busy_owner(cluster, "decode", 6, lambda p: hf_greedy(tiny_llama, p, 6))
    )
