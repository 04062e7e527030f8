"""KV streamed while the prompt is computed, over the real path: worker processes, real gRPC (WatchKV,
ProvideKV), real NIXL reads of blocks a prefill still running has pinned. Output equals the engine
alone and HF; short prompts keep the whole-handle path; a request cancelled mid-prefill and the
first-token-ends-it case leave every block free."""

from __future__ import annotations

import asyncio
import dataclasses
import signal

from pd_client import state
from test_router import Cluster

from engine import LLM
from engine.sampling_params import SamplingParams
from proto import pdserve_pb2 as pb
from proto.convert import params_to_proto

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
CHUNK = ("--max-num-batched-tokens", "32")  # the prefill worker computes 4 blocks of 8 per step


async def _drain(call) -> None:
    async for _ in call:
        pass


def test_streamed_kv_equals_the_engine_alone(workers, redis_server, tiny_llama, hf_greedy):
    long_prompts = [[(7 * i + 13 * k) % 900 + 3 for i in range(200 + 17 * k)] for k in range(3)]
    short = list(range(40, 50))
    alone = LLM(str(tiny_llama), num_blocks=128, block_size=8)
    want = [alone.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in [*long_prompts, short]]
    cluster = Cluster(workers, redis_server, 1, kv_flags=CHUNK)

    async def run():
        await cluster.start()
        try:
            cluster.router.kv_streaming_tokens = 64  # the short prompt stays on the whole-handle path
            for i, p in enumerate([*long_prompts, short]):
                assert await cluster.generate(f"q{i}", p) == want[i], i
            assert want[0] == hf_greedy(tiny_llama, long_prompts[0], GREEDY.max_tokens)
            assert cluster.router.stats.kv_streamed == len(long_prompts)
            decode = await state(cluster.decode.address, "decode")
            t = decode.transfer_stats
            assert t.failures == t.recomputed == 0
            # At least one prompt's blocks were read before its prefill ended.
            assert t.streamed >= 1 and t.streamed_bytes > 0, t

            # Cancelled while its prompt is being computed (the prefill worker is seen busy with it):
            # the decode worker aborts its streamed pull once its reads settle, and the prefill
            # worker frees the blocks it pinned.
            req = pb.GenerateRequest(
                request_id="gone", prompt_token_ids=long_prompts[2] * 2, params=params_to_proto(GREEDY)
            )
            call = cluster.stub.Generate(req, timeout=60)
            consumer = asyncio.ensure_future(_drain(call))
            prefill = cluster.prefills[0]
            while not consumer.done():
                s = (await state(prefill.address, "prefill")).stats
                if s.num_running + s.num_waiting:
                    break
            call.cancel()
            await asyncio.gather(consumer, return_exceptions=True)

            # The first token ends it: the streaming Decode is closed, nothing is left held.
            one = dataclasses.replace(GREEDY, max_tokens=1)
            assert await cluster.generate("one", long_prompts[1], one) == want[1][:1]
            await cluster.all_free()
        finally:
            await cluster.stop()

    asyncio.run(run())


def test_abort_mid_prefill_and_a_handle_not_taken(workers, redis_server, tiny_llama):
    """Router.Abort while the prompt is computed cancels the prefill: the stream ends with ``abort``
    and no token, though a Decode is already open (the prefill worker is held stopped, so the prefill
    cannot finish first). A decode worker that does not take the complete handle gets the request
    computed by itself, under an id of its own, with the engine's output."""
    prompt = [(11 * i) % 900 + 3 for i in range(300)]
    alone = LLM(str(tiny_llama), num_blocks=128, block_size=8)
    want = alone.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    cluster = Cluster(workers, redis_server, 1, kv_flags=CHUNK)
    router = cluster.router

    async def run():
        await cluster.start()
        try:
            router.kv_streaming_tokens = 64
            prefill = cluster.prefills[0].proc
            prefill.send_signal(signal.SIGSTOP)
            try:
                req = pb.GenerateRequest(
                    request_id="ab", prompt_token_ids=prompt, params=params_to_proto(GREEDY)
                )
                msgs = []

                async def consume():
                    async for msg in cluster.stub.Generate(req, timeout=60):
                        msgs.append(msg)

                consumer = asyncio.ensure_future(consume())
                deadline = asyncio.get_running_loop().time() + 30
                while "ab" not in router.cancellation.prefilling:  # its Decode is open, the prefill sent
                    assert asyncio.get_running_loop().time() < deadline, "the request never reached prefill"
                    await asyncio.sleep(0.01)
                assert "ab" in router.cancellation.decoding
                assert await router.abort("ab")
                await asyncio.wait_for(consumer, 30)
            finally:
                prefill.send_signal(signal.SIGCONT)
            assert [m.WhichOneof("kind") for m in msgs] == ["finished"]
            assert msgs[0].finished.finish_reason == "abort"
            await cluster.all_free()

            # The decode worker takes the handle, but the router sees a refusal (as after an RPC error
            # on the way back): the closed call may have freed the prompt, so it is not read again.
            provide = router._provide_kv

            async def refused(opened, handle, deadline) -> bool:
                await provide(opened, handle, deadline)
                return False

            router._provide_kv = refused
            assert await cluster.generate("refused", prompt) == want
            assert router.stats.kv_streamed == 0
            await cluster.all_free()
        finally:
            await cluster.stop()

    asyncio.run(run())
