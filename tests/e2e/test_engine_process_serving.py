"""Workers whose engine runs in a process of its own (``--engine-process``), over the real path:
worker processes, real NIXL between the prefill worker's engine process and the decode worker's
(where their KV memory is), real gRPC and Redis, the router in front. Disaggregated output equals the
engine alone and HF, KV streamed while the prompt is computed too; the pulls are counted; every
block is free after. Started with ``--kv-transfer inprocess`` the worker takes no hand-offs and the
router computes its prompts there, the prefill worker untouched."""

from __future__ import annotations

import asyncio
import random

from pd_client import state
from test_router import Cluster

from engine import LLM
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# The last prompt is long enough (7 chunks of 32 tokens) that its KV streams while it is computed;
# at 100 tokens a fast prefill could finish before the decode worker's read began (CI saw it).
PROMPTS = [list(range(100, 140)), [5, 9, 9, 17, 3, 3, 3, 40] * 3, [7, 8], list(range(200, 420))]


def _engine_alone(tiny_llama) -> list[list[int]]:
    alone = LLM(str(tiny_llama), num_blocks=128, block_size=8)
    return [alone.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


def test_disaggregated_through_an_engine_process_equals_the_engine_alone(
    workers, redis_server, tiny_llama, hf_greedy
):
    want = _engine_alone(tiny_llama)
    assert want[0] == hf_greedy(tiny_llama, PROMPTS[0], 10)
    # Both workers split; the prefill worker computes long prompts in small chunks (the 220-token
    # prompt over 28+ steps), so streamed reads start while its engine process still computes them
    # (with 32-token chunks an unloaded machine finished the prompt before the decode worker's watch).
    split_prefill = ("--engine-process", "--max-num-batched-tokens", "8")
    cluster = Cluster(
        workers, redis_server, 1, decode_flags=("--engine-process",), prefill_flags=split_prefill
    )

    async def run():
        await cluster.start()
        try:
            cluster.router.local_prefill_tokens = 0  # every prompt prefilled on the prefill worker
            cluster.router.kv_streaming_tokens = 64  # the 100-token prompt streams its KV
            prompts = PROMPTS * 2  # the second round finds the first's prefixes
            got = await asyncio.gather(*(cluster.generate(f"q{i}", p, GREEDY) for i, p in enumerate(prompts)))
            assert got == want * 2
            assert all(cluster.routes[f"q{i}"].prefill_worker == "p0" for i in range(len(prompts)))
            decode = await state(cluster.decode.address, "decode")
            assert decode.transfer.agent_name.startswith("d0-")  # its engine process's NIXL agent
            # A streamed read starts only if the decode worker's watch begins before the prompt's
            # last chunk, a race a loaded machine can lose: fresh long prompts (nothing cached),
            # each checked against HF, until one streamed (at most 5).
            rng = random.Random(3)
            for extra in range(5):
                if decode.transfer_stats.streamed >= 1:
                    break
                fresh = [rng.randrange(3, 1000) for _ in range(220)]
                assert await cluster.generate(f"s{extra}", fresh, GREEDY) == hf_greedy(tiny_llama, fresh, 10)
                decode = await state(cluster.decode.address, "decode")
            t = decode.transfer_stats
            assert t.completed >= len(PROMPTS) and t.bytes > 0 and t.recomputed == 0
            assert t.streamed >= 1
            prefill = await state(cluster.prefills[0].address, "prefill")
            assert prefill.transfer.agent_name.startswith("p0-")  # the prefill engine process's agent
            assert prefill.transfer_stats.expired_leases == 0  # every held prompt freed by its reader
            await cluster.all_free()
        finally:
            await cluster.stop()

    asyncio.run(run())


def test_without_a_transfer_agent_the_router_computes_its_prompts_there(workers, redis_server, tiny_llama):
    want = _engine_alone(tiny_llama)
    cluster = Cluster(
        workers, redis_server, 1, decode_flags=("--engine-process", "--kv-transfer", "inprocess")
    )

    async def run():
        await cluster.start()
        try:
            cluster.router.local_prefill_tokens = 0
            got = [await cluster.generate(f"a{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
            assert got == want
            routes = [cluster.routes.get(f"a{i}") for i in range(len(PROMPTS))]
            assert all(r is None or not r.prefill_worker for r in routes)  # none prefilled elsewhere
            prefill = await state(cluster.prefills[0].address, "prefill")
            assert prefill.stats.prompt_tokens == 0  # never asked
            await cluster.all_free()
        finally:
            await cluster.stop()

    asyncio.run(run())
