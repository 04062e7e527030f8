"""Prefill worker -> NIXL -> decode worker, each in its own process, over real gRPC.

Greedy output equals the engine alone and HF transformers; faults end in the right output or a clear
error; and after every test both workers' free KV blocks are back at their starting count.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from pd_client import StreamFailed, decode, generate, prefill, state

from engine import LLM, SamplingParams

BLOCK = 8
NUM_BLOCKS = 64
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
LONG_CONTEXT = 32768


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [(31 * i + 17 * seed) % 1000 + 3 for i in range(n)]


async def _wait_all_free(*workers, timeout: float = 10.0, num_blocks: int = NUM_BLOCKS) -> None:
    deadline = time.monotonic() + timeout
    while True:
        states = [await state(w.address, w.role) for w in workers]
        if all(
            s.stats.num_free_blocks == num_blocks
            and s.stats.num_held_requests == 0
            and s.stats.num_running == 0
            and s.stats.num_transferring == 0
            for s in states
        ):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks not back: {[(s.role, s.stats) for s in states]}")
        await asyncio.sleep(0.1)


@pytest.fixture(scope="module")
def long_llama(tiny_model_factory):
    """The tiny Llama with a long context: a request can ask for thousands of tokens."""
    return tiny_model_factory("llama", max_position_embeddings=LONG_CONTEXT)


@pytest.fixture(scope="module")
def engine_alone(tiny_llama):
    return LLM(str(tiny_llama), block_size=BLOCK, num_blocks=NUM_BLOCKS)


def test_disaggregated_output_equals_engine_and_hf(workers, engine_alone, tiny_llama, hf_greedy):
    p, d = workers("prefill"), workers("decode")
    prompts = {"short": _prompt(3), "one-block": _prompt(BLOCK, 1), "many-blocks": _prompt(5 * BLOCK + 3, 2)}

    async def run():
        for name, prompt in prompts.items():
            tokens = await generate(p.address, d.address, name, prompt, GREEDY)
            alone = engine_alone.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids
            assert tokens == alone == hf_greedy(tiny_llama, prompt, 10), name
        # The same long prompt again: the decode side reuses its own cached prefix blocks.
        before = (await state(d.address, "decode")).stats.prefix_cache_hits
        again = await generate(p.address, d.address, "again", prompts["many-blocks"], GREEDY)
        assert again == hf_greedy(tiny_llama, prompts["many-blocks"], 10)
        assert (await state(d.address, "decode")).stats.prefix_cache_hits - before == 5 * BLOCK
        await _wait_all_free(p, d)

    asyncio.run(run())


def test_seeded_sampling_spans_both_workers(workers, engine_alone):
    p, d = workers("prefill"), workers("decode", "--seed", "1234")
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, ignore_eos=True, seed=11)
    prompt = _prompt(21, 3)

    async def run():
        tokens = await generate(p.address, d.address, "s", prompt, params)
        assert tokens == engine_alone.generate([prompt], params, use_tqdm=False)[0].token_ids
        await _wait_all_free(p, d)

    asyncio.run(run())


def test_aggregated_mode_serves_whole_requests(workers, tiny_llama, hf_greedy):
    d = workers("decode")
    prompt = _prompt(19, 4)

    async def run():
        assert await decode(d.address, "agg", prompt, GREEDY) == hf_greedy(tiny_llama, prompt, 10)
        await _wait_all_free(d)

    asyncio.run(run())


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_prefill_killed_before_the_read(workers, tiny_llama, hf_greedy, policy):
    p, d = workers("prefill"), workers("decode", "--kv-failure-policy", policy, "--transfer-timeout", "3")
    prompt = _prompt(3 * BLOCK + 1, 5)

    async def run():
        await generate(p.address, d.address, "warm", _prompt(4), GREEDY)  # the decode side knows the peer
        resp = await prefill(p.address, "r", prompt, GREEDY)
        p.kill()
        if policy == "recompute":
            rest = await decode(d.address, "r", prompt, GREEDY, resp.handle)
            assert [resp.handle.first_token, *rest] == hf_greedy(tiny_llama, prompt, 10)
        else:
            with pytest.raises(StreamFailed) as err:
                await decode(d.address, "r", prompt, GREEDY, resp.handle)
            assert err.value.code == "kv_transfer_failed"
        await _wait_all_free(d)

    asyncio.run(run())


def test_client_cancel_mid_stream_frees_blocks(workers, long_llama):
    """A stream cancelled a few tokens into thousands: the decode worker aborts the request at once,
    it does not run to its end (which would take far longer than the wait below)."""
    num_blocks = LONG_CONTEXT // BLOCK + 16
    p = workers("prefill", model=long_llama, num_blocks=num_blocks)
    d = workers("decode", model=long_llama, num_blocks=num_blocks)
    prompt = _prompt(2 * BLOCK, 6)
    params = SamplingParams(temperature=0, max_tokens=LONG_CONTEXT - len(prompt), ignore_eos=True)

    async def run():
        before = (await state(d.address, "decode")).stats.generation_tokens
        resp = await prefill(p.address, "c", prompt, params)
        async with grpc.aio.insecure_channel(d.address) as ch:
            from proto import pdserve_pb2 as pb
            from proto import pdserve_pb2_grpc as pb_grpc
            from proto.convert import params_to_proto

            call = pb_grpc.DecodeWorkerStub(ch).Decode(
                pb.DecodeRequest(
                    request_id="c",
                    prompt_token_ids=prompt,
                    params=params_to_proto(params),
                    handle=resp.handle,
                )
            )
            got = 0
            async for msg in call:
                got += len(msg.tokens.token_ids)
                if got >= 3:
                    call.cancel()
                    break
        await _wait_all_free(p, d, timeout=10, num_blocks=num_blocks)
        generated = (await state(d.address, "decode")).stats.generation_tokens - before
        assert got <= generated < params.max_tokens // 2  # aborted, not run to its end

    asyncio.run(run())


def test_decode_worker_dies_and_the_lease_frees_prefill_blocks(workers):
    p, d = workers("prefill", "--lease-seconds", "1.5"), workers("decode")
    prompt = _prompt(4 * BLOCK, 7)

    async def run():
        resp = await prefill(p.address, "orphan", prompt, GREEDY)
        assert (await state(p.address, "prefill")).stats.num_held_requests == 1
        d.kill()
        assert resp.handle.lease_expiry_unix > time.time()
        await _wait_all_free(p, timeout=10)

    asyncio.run(run())


def test_release_and_late_notification_are_harmless(workers):
    p, d = workers("prefill"), workers("decode")
    prompt = _prompt(2 * BLOCK + 2, 8)

    async def run():
        from proto import pdserve_pb2 as pb
        from proto import pdserve_pb2_grpc as pb_grpc

        resp = await prefill(p.address, "late", prompt, GREEDY)
        async with grpc.aio.insecure_channel(p.address) as ch:
            stub = pb_grpc.PrefillWorkerStub(ch)
            assert (await stub.Release(pb.ReleaseRequest(request_id="late"))).released
            assert not (await stub.Release(pb.ReleaseRequest(request_id="late"))).released
        # The decode side still pulls and notifies: the notification names a freed request.
        await decode(d.address, "late", prompt, GREEDY, resp.handle)
        await generate(p.address, d.address, "after", _prompt(5, 9), GREEDY)  # both still serve
        await _wait_all_free(p, d)

    asyncio.run(run())


def test_bad_requests_are_refused_at_the_edge(workers):
    p, d = workers("prefill"), workers("decode")

    async def run():
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await prefill(p.address, "bad", [1, 2, 99999], GREEDY)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await prefill(p.address, "bad2", [], GREEDY)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await decode(d.address, "bad3", [1] * 600, SamplingParams(max_tokens=10))
        assert "context length" in err.value.details()
        await _wait_all_free(p, d)

    asyncio.run(run())


def test_read_timeout_falls_back_to_recompute(workers, tiny_llama, hf_greedy):
    import signal

    p, d = workers("prefill", "--lease-seconds", "4"), workers("decode", "--transfer-timeout", "2")
    prompt = _prompt(3 * BLOCK + 5, 10)

    async def run():
        await generate(p.address, d.address, "warm", _prompt(4), GREEDY)  # the decode side knows the peer
        resp = await prefill(p.address, "slow", prompt, GREEDY)
        p.proc.send_signal(signal.SIGSTOP)  # the owner cannot serve the read: it must time out
        try:
            started = time.monotonic()
            rest = await decode(d.address, "slow", prompt, GREEDY, resp.handle)
            assert time.monotonic() - started >= 2
            assert [resp.handle.first_token, *rest] == hf_greedy(tiny_llama, prompt, 10)
            # NIXL cannot abort the stalled READ: its target blocks stay quarantined, not reused.
            quarantined = (await state(d.address, "decode")).stats
            assert quarantined.num_held_requests == 1 and quarantined.num_transferring == 0
        finally:
            p.proc.send_signal(signal.SIGCONT)
        await _wait_all_free(d)  # the read lands once the owner runs again; then they are freed
        await _wait_all_free(p, timeout=15)  # its lease frees the blocks it still held

    asyncio.run(run())


def test_prefill_deadline_aborts_the_request(workers):
    p = workers("prefill", "--max-num-batched-tokens", "1")  # one token per step: ~500 steps
    prompt = _prompt(500, 11)

    async def run():
        async with grpc.aio.insecure_channel(p.address) as ch:
            from proto import pdserve_pb2 as pb
            from proto import pdserve_pb2_grpc as pb_grpc
            from proto.convert import params_to_proto

            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb_grpc.PrefillWorkerStub(ch).Prefill(
                    pb.PrefillRequest(
                        request_id="late", prompt_token_ids=prompt, params=params_to_proto(GREEDY)
                    ),
                    timeout=0.1,
                )
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await _wait_all_free(p)
        # The id is free again: nothing of the expired request is left behind.
        assert (await prefill(p.address, "late", _prompt(5), GREEDY)).handle.block_ids
        async with grpc.aio.insecure_channel(p.address) as ch:
            from proto import pdserve_pb2 as pb
            from proto import pdserve_pb2_grpc as pb_grpc

            assert (
                await pb_grpc.PrefillWorkerStub(ch).Release(pb.ReleaseRequest(request_id="late"))
            ).released
        await _wait_all_free(p)

    asyncio.run(run())


@pytest.mark.parametrize("lease", ["30", "2.0"])  # 2.0: a second to start in (LEASE_MARGIN_S)
def test_decode_without_room_waits_for_blocks_or_recomputes(workers, engine_alone, lease):
    """More pulled prompts than the decode pool holds: pulls wait (FIFO) for blocks instead of failing,
    and a pull that cannot start before the prefill lease ends recomputes locally; all outputs exact."""
    p = workers("prefill", "--lease-seconds", lease)
    d = workers("decode", num_blocks=24)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [_prompt(60, seed=s) for s in range(6)]  # 8 blocks to pull each: 3 fit at once
    expected = [o.token_ids for o in engine_alone.generate(prompts, params)]

    async def main():
        got = await asyncio.gather(
            *(generate(p.address, d.address, f"room-{i}", pr, params) for i, pr in enumerate(prompts))
        )
        deadline = time.monotonic() + 15
        while True:
            ps, ds = await state(p.address, "prefill"), await state(d.address, "decode")
            idle = (
                ps.stats.num_held_requests == 0
                and ds.stats.num_running == 0
                and ds.stats.num_transferring == 0
            )
            if idle and ps.stats.num_free_blocks == NUM_BLOCKS and ds.stats.num_free_blocks == 24:
                return got, ds
            assert time.monotonic() < deadline, (ps.stats, ds.stats)
            await asyncio.sleep(0.1)

    got, ds = asyncio.run(main())
    assert got == expected
    t = ds.transfer_stats
    assert t.completed + t.recomputed == 6 and t.waited >= 1
    if lease == "1.0":  # no time left on the lease to wait in: waiters recompute at once
        assert t.recomputed == t.waited


def test_decode_warms_nixl_peers_before_its_first_pull(workers, engine_alone, tiny_llama):
    """``warm_peers`` (what a decode replica runs before it registers) connects NIXL to every reachable
    prefill worker, skips unreachable ones, and the first pull then fetches no metadata."""
    from decode_worker.peers import fetch_prefill_peer
    from decode_worker.service import pulled_kv_from_handle
    from decode_worker.worker import DecodeWorker, DecodeWorkerConfig
    from engine import EngineConfig

    p = workers("prefill")
    fetched: list[str] = []

    async def fetch(address: str):
        fetched.append(address)
        return await fetch_prefill_peer(address, timeout_s=5)

    config = EngineConfig(model=str(tiny_llama), block_size=BLOCK, num_blocks=NUM_BLOCKS)
    worker = DecodeWorker(DecodeWorkerConfig(config, worker_id="d-warm"), fetch_peer=fetch)
    worker.start()
    prompt = _prompt(30, seed=3)

    async def main():
        assert await worker.warm_peers([p.address, "127.0.0.1:1"]) == 1  # the second is not listening
        assert await worker.warm_peers([p.address]) == 0  # already connected: not added twice
        seen = list(fetched)
        resp = await prefill(p.address, "warm", prompt, GREEDY)
        tokens = [resp.handle.first_token]
        async for out in worker.decode("warm", prompt, GREEDY, kv=pulled_kv_from_handle(resp.handle)):
            tokens.extend(out.new_token_ids)
        assert fetched == seen  # the pull used the warmed connection
        stats = await worker.stats()
        assert stats.num_free_blocks == NUM_BLOCKS and stats.num_running == 0
        return tokens

    try:
        assert asyncio.run(main()) == engine_alone.generate([prompt], GREEDY)[0].token_ids
        asyncio.run(_wait_all_free(p))
    finally:
        worker.stop()
