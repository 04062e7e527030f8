"""KV streamed while the prompt is computed, over the real path: worker processes, real gRPC (WatchKV,
ProvideKV), real NIXL reads of blocks a prefill still running has pinned. Output equals the engine
alone and HF; short prompts keep the whole-handle path; a request cancelled mid-prefill and the
first-token-ends-it case leave every block free."""

from __future__ import annotations

import asyncio
import dataclasses

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
