"""int8 KV over the real path: worker processes, real NIXL moving quantized blocks with their
scales, the router's prefix index keyed by the KV dtype; output equals the int8 engine alone."""

from __future__ import annotations

import asyncio
import subprocess

from pd_client import state
from test_router import Cluster

from engine import LLM
from engine.sampling_params import SamplingParams
from registry.schema import connect, read_workers


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


def test_a_worker_with_another_kv_dtype_is_refused_at_registration(workers, redis_server, tiny_llama):
    """An int8 decode worker cannot join a pool whose prefill worker keeps float32 KV: it exits at
    start with the reason, before it is routable (never a silently wrong pull, nor a failure per
    request)."""
    prefill = workers("prefill", "--redis-url", redis_server.url, "--worker-id", "p0")
    args = [a if a != "prefill_worker" else "decode_worker" for a in prefill.args]
    args[args.index("p0")] = "d-int8"
    proc = subprocess.run([*args, "--kv-cache-dtype", "int8"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "LISTENING" not in proc.stdout
    assert "decode worker d-int8 keeps the KV" in proc.stderr and "int8 blocks" in proc.stderr
    assert "p0 keep it as float32 blocks" in proc.stderr
    client = connect(redis_server.url)
    try:
        assert set(read_workers(client)) == {"p0"}
    finally:
        client.close()
