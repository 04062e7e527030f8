"""int8 KV over the real path: worker processes, real NIXL moving quantized blocks with their
scales, the router's prefix index keyed by the KV dtype; output equals the int8 engine alone."""

from __future__ import annotations

import asyncio

from pd_client import state
from test_router import Cluster

from engine import LLM
from engine.sampling_params import SamplingParams


def test_int8_kv_disaggregated_equals_the_int8_engine_alone(workers, redis_server, tiny_llama):
    prompts = [list(range(100, 140)), [5, 9, 9, 17, 3, 3, 3, 40] * 3, [7, 8]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = LLM(str(tiny_llama), num_blocks=128, block_size=8, kv_cache_dtype="int8")
    want = [alone.generate(p, greedy, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    cluster = Cluster(workers, redis_server, 1, kv_flags=("--kv-cache-dtype", "int8"))

    async def run():
        await cluster.start()
        try:
            cluster.router.local_prefill_tokens = 0  # every prompt prefilled on the prefill worker
            for i, p in enumerate(prompts):
                assert await cluster.generate(f"q{i}", p, greedy) == want[i], i
                assert cluster.routes[f"q{i}"].prefill_worker == "p0"
            # The same prompt again: the router predicts the prefill worker's int8 blocks as a hit.
            assert await cluster.generate("again", prompts[0], greedy) == want[0]
            assert cluster.routes["again"].predicted_hit_tokens >= 32
            decode = await state(cluster.decode.address, "decode")
            assert decode.transfer_stats.completed >= len(prompts)
            assert decode.cache_salt.endswith("|kv=int8")
            await cluster.all_free()
        finally:
            await cluster.stop()

    asyncio.run(run())
