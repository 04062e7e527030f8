"""Reliability under faults: ``python -m bench.chaos`` at small scale. ``pdserve serve`` (2 prefill + 2
decode replicas, a real redis-server, KV pools small enough that requests get preempted) streams
greedy completions, 20% of them abandoned by their clients mid-stream, while the busiest decode
replica is SIGKILLed, the busiest one then stopped (SIGSTOP) for 7 s (past the 5 s stall deadline),
and Redis killed and restarted empty — each fault striking mid-stream, the next one only once the
service is whole again.

No request is lost: every one that was not abandoned completes with the engine alone's output (a
lost decode worker's requests move to another one and just continue), none ends in an error or
hangs, and afterwards every worker is idle with all its KV blocks free. The only processes signalled
are replicas in the session of the ``serve`` this test started. ``--soak-seconds N`` goes through
the faults again and again for N seconds (``bash scripts/test.sh -m reliability --soak-seconds
600``: a ten-minute soak).
"""

from __future__ import annotations

import asyncio
import random

import pytest
from conftest import API_KEY, ServeProcess

from bench.chaos import run_chaos
from engine import LLM, SamplingParams

pytestmark = [pytest.mark.reliability, pytest.mark.ray, pytest.mark.slow]

PROMPT_LEN, MAX_TOKENS = 160, 48  # 13 blocks a request: 6 streams overflow one decode pool of 48
# A killed prefill replica: tests/deploy/test_serve_faults.py; a stopped one: tests/e2e/test_worker_faults.py.
FAULTS = ["kill_decode", "stop_decode", "restart_redis"]


def test_faults_under_streaming_load_lose_no_request(serve_model, module_redis_server, request):
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 1000) for _ in range(PROMPT_LEN)] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    references = [o.outputs[0].text for o in LLM(str(serve_model), num_blocks=128).generate(prompts, params)]
    svc = ServeProcess(
        serve_model, module_redis_server.url,
        "--prefill", "2", "--decode", "2", "--worker-cpus", "0.25", "--ray-cpus", "8", "--num-blocks", "48",
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
                concurrency=6,
                max_tokens=MAX_TOKENS,
                faults=FAULTS,
                expect={"prefill": 2, "decode": 2},
                stall_s=7,
                deadline_s=120,
                headers={"Authorization": f"Bearer {API_KEY}"},
                cancel_rate=0.2,
                soak_s=request.config.getoption("--soak-seconds"),
            )
        )
        kinds = ("requests", "identical", "cancelled", "wrong", "error", "unclear_error", "hung")
        summary = {k: res[k] for k in kinds}
        faults = [(f["kind"], f["victim"], f["longest_silence_s"], f["not_restored"]) for f in res["faults"]]
        print("\nchaos:", summary, "faults:", faults, "errors:", res["errors"])
        assert [f["kind"] for f in res["faults"]][: len(FAULTS)] == FAULTS
        assert all(f["open_streams"] for f in res["faults"])  # each struck while streams ran
        assert res["hung"] == 0 and res["wrong"] == 0, summary
        assert res["identical"] + res["cancelled"] == res["requests"], (summary, res["errors"])
        assert res["identical"] >= 10 and res["cancelled"] >= 1, summary
        assert res["blocks_leaked"] == 0 and res["idle_at_end"], res
        m = svc.metrics()
        assert sum(v for (n, _), v in m.items() if n == "pdserve_preemptions_total") > 0  # pools overflowed
        assert m[("pdserve_router_migrations_total", ())] >= 1
    finally:
        code = svc.terminate()
    assert code == 0
