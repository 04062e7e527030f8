"""Peer reads between two decode workers in aggregated mode (engines on the workers' threads) over
real gRPC, their host tiers on one in-process fabric: an aggregated Decode with a ``PeerPrefix``
reads the peer's blocks and serves them as host hits, output unchanged; a peer that is gone or holds
nothing leaves the prompt to compute; a stream cancelled mid-read drops the read; bad input is
refused at the edge. Every block and lease is back afterwards."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from decode_worker.service import serve
from decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from engine import EngineConfig
from kv_transfer import InProcessFabric
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

BS = 8
MAX_TOKENS = 4
PARAMS = pb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _prompt(seed: int, n: int = 90) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


class Pair:
    def __init__(self, tiny_llama) -> None:
        self.fabric = InProcessFabric()
        engine = EngineConfig(model=str(tiny_llama), block_size=BS, num_blocks=32, kv_host_cache_gib=0.001)
        # Long deadlines: a read held by the test must not time out first on a loaded machine.
        config = dict(peer_read_timeout_s=60.0, lend_lease_s=180.0)
        self.workers = [
            DecodeWorker(
                DecodeWorkerConfig(engine, worker_id=f"d{i}", **config),
                fetch_peer=None,
                transfer_factory=self.fabric.transfer_factory,
            )
            for i in range(2)
        ]
        self.addresses: list[str] = []

    def peer(self, i: int, num_blocks: int = 11) -> pb.PeerPrefix:
        return pb.PeerPrefix(worker_id=f"d{i}", address=self.addresses[i], num_blocks=num_blocks)

    async def decode(self, i: int, rid: str, prompt, peer: pb.PeerPrefix | None = None):
        """(tokens, cached prompt tokens) of an aggregated Decode on worker ``i``."""
        req = pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt, params=PARAMS)
        if peer is not None:
            req.peer.CopyFrom(peer)
        tokens, cached = [], None
        async with grpc.aio.insecure_channel(self.addresses[i]) as channel:
            async for msg in pb_grpc.DecodeWorkerStub(channel).Decode(req):
                kind = msg.WhichOneof("kind")
                assert kind != "error", msg.error
                if kind == "tokens":
                    tokens += msg.tokens.token_ids
                elif kind == "finished":
                    cached = msg.finished.usage.cached_tokens
        return tokens, cached

    def run(self, body) -> None:
        async def main():
            for w in self.workers:
                _server, address = await serve(w)
                self.addresses.append(address)
            try:
                await body()
                for w in self.workers:  # every lease over, every block back
                    await w.loop.run(lambda w=w: w.tiers.tick())
                    assert await w.busy() == 0
                    assert not await w.loop.run(lambda w=w: w.tiers.lending.leases)
                    s = await w.stats()
                    assert s.num_free_blocks == s.num_blocks
            finally:
                for w in self.workers:
                    await w.shutdown(0)

        asyncio.run(main())


@pytest.fixture
def pair(tiny_llama):
    return Pair(tiny_llama)


def test_an_aggregated_decode_reads_its_prefix_from_a_peer(pair, tiny_llama, hf_greedy):
    prompt = _prompt(1)

    async def body():
        first, _ = await pair.decode(0, "a", prompt)
        assert first == hf_greedy(tiny_llama, prompt, MAX_TOKENS)
        read, cached = await pair.decode(1, "b", prompt, pair.peer(0))
        assert read == first
        assert cached == 11 * BS  # every block it did not compute came from d0
        d0, d1 = pair.workers
        assert (await d1.stats()).peer_received_blocks == 11
        assert (await d1.stats()).prefix_cache_hits_host == 11 * BS
        assert (await d0.stats()).peer_lent_blocks == 11

    pair.run(body)


def test_a_peer_that_is_gone_or_holds_nothing_leaves_the_prompt_to_compute(pair, tiny_llama, hf_greedy):
    prompt, other = _prompt(2), _prompt(3)

    async def body():
        await pair.decode(0, "a", prompt)
        gone = pb.PeerPrefix(worker_id="d9", address="127.0.0.1:1", num_blocks=11)
        assert await pair.decode(1, "b", prompt, gone) == (hf_greedy(tiny_llama, prompt, MAX_TOKENS), 0)
        # d0 never saw ``other``: nothing lent, nothing read
        assert await pair.decode(1, "c", other, pair.peer(0)) == (hf_greedy(tiny_llama, other, MAX_TOKENS), 0)
        assert (await pair.workers[1].stats()).peer_received_blocks == 0

    pair.run(body)


def test_a_stream_cancelled_mid_read_drops_the_read(pair):
    """The read is held (the fabric lands nothing) and counts as work a drain waits for; the caller
    leaves: the read is dropped at once (nothing pending), the request never runs, and once the
    bytes land the slots settle."""
    prompt = _prompt(4)
    d1 = pair.workers[1]

    async def until(check, what: str) -> None:
        deadline = time.monotonic() + 30
        while not await check():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.01)

    async def body():
        await pair.decode(0, "a", prompt)
        pair.fabric.stall_reads()
        call = asyncio.ensure_future(pair.decode(1, "b", prompt, pair.peer(0)))
        await until(lambda: d1.loop.run(d1.tiers.pending), "the read never started")
        assert await d1.busy() == 1  # a drain waits for it
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        await until(lambda: d1.loop.run(lambda: d1.tiers.pending() == 0), "the read was not dropped")
        assert (await d1.stats()).num_running == 0
        pair.fabric.resume_reads()
        await d1.loop.run(d1.tiers.tick)
        await pair.workers[0].loop.run(pair.workers[0].tiers.tick)  # the reader's notification ends the lease
        assert not await d1.loop.run(lambda: d1.tiers._unsettled)

    pair.run(body)


def test_bad_input_is_refused_at_the_edge(pair):
    async def body():
        async with grpc.aio.insecure_channel(pair.addresses[1]) as channel:
            stub = pb_grpc.DecodeWorkerStub(channel)
            handle = pb.KVHandle(request_id="x", agent_name="p", num_tokens=3, compat_hash="c")
            bad = [
                pb.DecodeRequest(
                    request_id="h", prompt_token_ids=[1, 2, 3], handle=handle, peer=pair.peer(0)
                ),
                pb.DecodeRequest(
                    request_id="s", prompt_token_ids=[1, 2, 3], kv_source="x:1", peer=pair.peer(0)
                ),
                pb.DecodeRequest(
                    request_id="n", prompt_token_ids=[1, 2, 3], peer=pb.PeerPrefix(num_blocks=1)
                ),
            ]
            for req in bad:
                req.params.CopyFrom(PARAMS)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Decode(req):
                        pass
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req.request_id
            for req in [
                pb.LendRequest(prompt_token_ids=[1, 2, 3], max_blocks=1),  # no lease id
                pb.LendRequest(lease_id="x" * 65, prompt_token_ids=[1, 2, 3], max_blocks=1),
                pb.LendRequest(lease_id="long", prompt_token_ids=[5] * 100_000, max_blocks=1),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Lend(req)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            lent = await stub.Lend(pb.LendRequest(lease_id="ok", prompt_token_ids=[1] * 40))
            assert list(lent.slots) == []

    pair.run(body)
