"""Peer reads between two prefill workers (engines in the workers' processes) over real gRPC, their
host tiers on one in-process fabric: a Prefill with a ``PeerPrefix`` reads the peer's blocks and
serves them as host hits; a peer that is gone, or holds nothing, leaves the prompt to compute with
the same first token; Lend refuses bad input at the edge. Every block and lease is back afterwards."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from engine import EngineConfig, SamplingParams
from kv_transfer import InProcessFabric
from prefill_worker.service import serve
from prefill_worker.worker import PrefillWorker, PrefillWorkerConfig
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

BS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _prompt(seed: int, n: int = 90) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


@pytest.fixture
def pair(tiny_llama, lora_adapter_factory):
    fabric = InProcessFabric()
    adapter = str(lora_adapter_factory(tiny_llama, seed=5))
    engine = EngineConfig(
        model=str(tiny_llama),
        block_size=BS,
        num_blocks=32,
        kv_host_cache_gib=0.001,
        enable_lora=True,
        lora_modules={"a": adapter},
    )
    workers = [
        PrefillWorker(PrefillWorkerConfig(engine, worker_id=f"p{i}"), fabric.transfer_factory)
        for i in range(2)
    ]
    yield workers


def _run(workers, body) -> None:
    async def main():
        addresses = []
        for w in workers:
            _server, address = await serve(w)
            addresses.append(address)
        try:
            await body(addresses)
            for w in workers:  # every lease over, every block back
                await w.loop.run(lambda w=w: w.tiers.tick())
                assert await w.busy() == 0
                assert not await w.loop.run(lambda w=w: w.tiers.lending.leases)
                s = await w.stats()
                assert s.num_free_blocks == s.num_blocks
        finally:
            for w in workers:
                await w.shutdown(0)

    asyncio.run(main())


async def _prefill(worker: PrefillWorker, rid: str, prompt, peer: pb.PeerPrefix | None = None, params=GREEDY):
    result = await worker.prefill(rid, prompt, params, peer=peer)
    assert await worker.release(rid)
    return result


def test_a_prefill_reads_its_prefix_from_a_peer(pair):
    p0, p1 = pair
    prompt = _prompt(1)

    async def body(addresses):
        first = await _prefill(p0, "a", prompt)
        peer = pb.PeerPrefix(worker_id="p0", address=addresses[0], num_blocks=11)
        read = await _prefill(p1, "b", prompt, peer)
        assert read.first_token == first.first_token
        assert read.num_cached_tokens == 11 * BS  # every block it did not compute came from p0
        assert (await p1.stats()).peer_received_blocks == 11
        assert (await p0.stats()).peer_lent_blocks == 11

    _run(pair, body)


def test_an_adapters_prompt_reads_the_peers_blocks_of_that_adapter(pair):
    """The Lend call names the request's adapter's cache namespace: p0 lends the blocks it computed
    with the adapter (not the base model's it also holds), and p1 serves the prompt from them."""
    p0, p1 = pair
    prompt = _prompt(3)
    lora = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, lora="a")

    async def body(addresses):
        await _prefill(p0, "base", prompt)
        first = await _prefill(p0, "a", prompt, params=lora)
        peer = pb.PeerPrefix(worker_id="p0", address=addresses[0], num_blocks=11)
        read = await _prefill(p1, "b", prompt, peer, params=lora)
        assert read.first_token == first.first_token
        assert read.num_cached_tokens == 11 * BS
        assert (await p1.stats()).peer_received_blocks == 11

    _run(pair, body)


def test_a_peer_that_is_gone_or_holds_nothing_leaves_the_prompt_to_compute(pair):
    p0, p1 = pair
    prompt = _prompt(2)

    async def body(addresses):
        first = await _prefill(p0, "a", prompt)
        gone = pb.PeerPrefix(worker_id="p9", address="127.0.0.1:1", num_blocks=11)
        computed = await _prefill(p1, "b", prompt, gone)
        assert (computed.first_token, computed.num_cached_tokens) == (first.first_token, 0)
        empty = pb.PeerPrefix(worker_id="p0", address=addresses[0], num_blocks=11)
        other = _prompt(3)
        fresh = await _prefill(p1, "c", other, empty)  # p0 never saw it: nothing lent, nothing read
        assert fresh.num_cached_tokens == 0
        assert (await p1.stats()).peer_received_blocks == 0

    _run(pair, body)


def test_lend_refuses_bad_input_at_the_edge(pair):
    async def body(addresses):
        async with grpc.aio.insecure_channel(addresses[0]) as channel:
            stub = pb_grpc.PrefillWorkerStub(channel)
            bad = [
                pb.LendRequest(prompt_token_ids=[1, 2, 3], max_blocks=1),  # no lease id
                pb.LendRequest(lease_id="x" * 65, prompt_token_ids=[1, 2, 3], max_blocks=1),
                pb.LendRequest(lease_id="long", prompt_token_ids=[5] * 100_000, max_blocks=1),
            ]
            for req in bad:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Lend(req)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (
                list((await stub.Lend(pb.LendRequest(lease_id="ok", prompt_token_ids=[1] * 40))).slots) == []
            )

    _run(pair, body)
