"""``python -m bench.chaos`` at small scale: ``pdserve serve`` (2 prefill + 2 decode replicas, a real
redis-server) streams greedy completions while a decode replica is SIGKILLed, another is stopped
(SIGSTOP) and later continued, a prefill replica is SIGKILLed and Redis is killed and restarted
empty — each fault striking mid-stream, the next one only once the service is whole again.

No request is lost: every one completes with the engine alone's output (the decode worker's
requests migrate to another one and just continue), none ends in an error or hangs, and afterwards
every worker is idle with all its KV blocks free. The only processes signalled are replicas in the
session of the ``serve`` this test started.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from conftest import API_KEY, ServeProcess

from bench.chaos import run_chaos
from engine import LLM, SamplingParams

pytestmark = [pytest.mark.reliability, pytest.mark.ray, pytest.mark.slow]

PROMPT_LEN, MAX_TOKENS = 48, 48


def test_chaos_loses_no_request(serve_model, module_redis_server):
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 1000) for _ in range(PROMPT_LEN)] for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    references = [o.outputs[0].text for o in LLM(str(serve_model), num_blocks=64).generate(prompts, params)]
    svc = ServeProcess(
        serve_model, module_redis_server.url,
        "--prefill", "2", "--decode", "2", "--worker-cpus", "0.25", "--ray-cpus", "8",
    )  # fmt: skip
    try:
        svc.wait_workers(2, 2)
        res = asyncio.run(
            run_chaos(
                svc.base,
                svc.proc.pid,
                module_redis_server,
                prompts,
                references,
                requests=24,
                concurrency=4,
                max_tokens=MAX_TOKENS,
                faults=["kill_decode", "stop_decode", "kill_prefill", "restart_redis"],
                expect={"prefill": 2, "decode": 2},
                stall_s=10,
                deadline_s=120,
                headers={"Authorization": f"Bearer {API_KEY}"},
            )
        )
        summary = {k: res[k] for k in ("requests", "identical", "wrong", "error", "unclear_error", "hung")}
        faults = [(f["kind"], f["victim"], f["streams_resumed_s"], f["not_restored"]) for f in res["faults"]]
        print("\nchaos:", summary, "faults:", faults, "errors:", res["errors"])
        assert [f["kind"] for f in res["faults"]] == [
            "kill_decode",
            "stop_decode",
            "kill_prefill",
            "restart_redis",
        ]
        assert all(f["open_streams"] for f in res["faults"])  # each struck while streams ran
        assert res["hung"] == 0 and res["wrong"] == 0, summary
        assert res["identical"] == res["requests"], (summary, res["errors"])
        assert res["blocks_leaked"] == 0 and res["idle_at_end"], res
    finally:
        code = svc.terminate()
    assert code == 0
