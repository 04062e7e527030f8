"""Reliability under faults: ``pdserve serve`` (2 prefill + 2 decode replicas on Ray Serve, a real
redis-server) under a steady load of streaming requests, while a prefill worker and a decode worker
are SIGKILLed, Redis is killed and restarted empty, 20% of requests are cancelled by their clients
at a random point, and the decode KV pools are small enough that requests get preempted.

Every request that was not cancelled must either complete with the reference output (greedy, equal
to the engine alone) or end with a clear error — none may hang past its deadline; the service must
recover (killed replicas replaced by Serve, the registry rebuilt) and serve correctly again; and at
the end every worker has no running request and all its KV blocks free.

``--soak-seconds N`` repeats the fault cycle for N seconds (e.g. 600 for a ten-minute soak).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from dataclasses import dataclass

import aiohttp
import pytest
from conftest import API_KEY, ServeProcess

from engine import LLM, SamplingParams

pytestmark = [pytest.mark.reliability, pytest.mark.ray, pytest.mark.slow]

PROMPT_LEN, MAX_TOKENS, CONCURRENCY, CANCEL_RATE = 200, 96, 8, 0.2
DEADLINE_S = 120  # a request still open after this has hung


@dataclass
class Outcome:
    prompt: int
    kind: str  # completed | cancelled | error | hung
    text: str = ""
    detail: str = ""


def _prompts(n: int = 8) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(10, 1000) for _ in range(PROMPT_LEN)] for _ in range(n)]


async def _one(session, svc, name, prompts, i, rng, cancel_rate: float = CANCEL_RATE) -> Outcome:
    idx = i % len(prompts)
    cancel_after = rng.randint(1, 8) if rng.random() < cancel_rate else None
    body = {
        "model": name,
        "prompt": prompts[idx],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }

    async def run() -> Outcome:
        parts: list[str] = []
        async with session.post(svc.base + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                text = await resp.text()
                err = json.loads(text).get("error", {}) if text.startswith("{") else {}
                assert err.get("message"), f"unclear error: HTTP {resp.status} {text[:200]}"
                return Outcome(idx, "error", detail=f"HTTP {resp.status}: {err['message']}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    assert event["error"].get("message"), event
                    return Outcome(idx, "error", detail=event["error"]["message"])
                parts.append(event["choices"][0]["text"])
                if cancel_after is not None and len(parts) >= cancel_after:
                    return Outcome(idx, "cancelled")  # leaving the block closes the connection
        return Outcome(idx, "completed", text="".join(parts))

    try:
        return await asyncio.wait_for(run(), DEADLINE_S)
    except asyncio.TimeoutError:
        return Outcome(idx, "hung")
    except aiohttp.ClientError as exc:  # the connection itself failed: still an answer, not a hang
        return Outcome(idx, "error", detail=f"{type(exc).__name__}: {exc}")


async def _load(svc, name, prompts, stop: asyncio.Event, outcomes: list[Outcome]) -> None:
    rng = random.Random(11)
    counter = iter(range(10**9))
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with aiohttp.ClientSession(headers=headers) as session:

        async def client() -> None:
            while not stop.is_set():
                outcomes.append(await _one(session, svc, name, prompts, next(counter), rng))

        await asyncio.gather(*(client() for _ in range(CONCURRENCY)))


def _diverges_at(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


async def _fault_cycle(svc: ServeProcess, redis, log: list[str]) -> None:
    # The pids come from this test's own service and are checked to be its processes.
    await asyncio.to_thread(svc.wait_workers, 2, 2)
    prefill = await asyncio.to_thread(svc.worker_pids, "prefill")
    decode = await asyncio.to_thread(svc.worker_pids, "decode")
    assert len(prefill) == 2 and len(decode) == 2, (prefill, decode)
    await asyncio.sleep(4)
    victim = sorted(prefill)[0]
    os.kill(prefill[victim], signal.SIGKILL)
    log.append(f"SIGKILL prefill {victim}")
    await asyncio.sleep(8)
    victim_d = sorted(decode)[0]
    os.kill(decode[victim_d], signal.SIGKILL)
    log.append(f"SIGKILL decode {victim_d}")
    await asyncio.sleep(8)
    redis.kill()
    log.append("redis killed")
    await asyncio.sleep(4)
    redis.start()
    log.append("redis restarted (empty)")
    # Recovery: Serve replaces the killed replicas; they and the survivors register again.
    deadline = time.monotonic() + 180
    while True:
        workers = await asyncio.to_thread(svc.workers)
        roles = [w.split("-")[0] for w in workers]
        if (
            roles.count("prefill") == 2
            and roles.count("decode") == 2
            and victim not in workers
            and victim_d not in workers
        ):
            break
        assert time.monotonic() < deadline, f"did not recover: {workers}"
        await asyncio.sleep(1)
    log.append("recovered: 2 prefill + 2 decode registered")


def test_faults_under_streaming_load(serve_model, module_redis_server, request):
    prompts = _prompts()
    reference = [
        o.text
        for o in LLM(str(serve_model), block_size=16, num_blocks=128).generate(
            prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        )
    ]
    svc = ServeProcess(
        serve_model,
        module_redis_server.url,
        "--prefill", "2", "--decode", "2", "--worker-cpus", "0.5", "--ray-cpus", "8",
        "--num-blocks", "48",  # 19 blocks per request at full length: 4 per decode worker must preempt
    )  # fmt: skip
    soak = request.config.getoption("--soak-seconds")
    log: list[str] = []
    outcomes: list[Outcome] = []
    try:
        name = svc.request("GET", "/v1/models")[2]["data"][0]["id"]

        async def main() -> None:
            stop = asyncio.Event()
            load = asyncio.create_task(_load(svc, name, prompts, stop, outcomes))
            t_end = time.monotonic() + soak
            await _fault_cycle(svc, module_redis_server, log)
            while time.monotonic() < t_end:
                await _fault_cycle(svc, module_redis_server, log)
            await asyncio.sleep(3)
            stop.set()
            await load

        asyncio.run(main())
        summary = {k: sum(o.kind == k for o in outcomes) for k in ("completed", "cancelled", "error", "hung")}
        print("\nfaults:", "; ".join(log), "\noutcomes:", summary)
        assert summary["hung"] == 0, summary
        wrong = [o for o in outcomes if o.kind == "completed" and o.text != reference[o.prompt]]
        assert not wrong, f"{len(wrong)} completed with a wrong output; faults: {log}; " + "; ".join(
            f"prompt {o.prompt} diverges at char {_diverges_at(o.text, reference[o.prompt])}" for o in wrong
        )
        assert summary["completed"] >= 10 and summary["cancelled"] >= 1, summary
        errors = {o.detail for o in outcomes if o.kind == "error"}
        print("errors:", sorted(errors)[:10])

        # The service is healthy again: every request completes correctly.
        async def after() -> list[Outcome]:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as s:
                rng = random.Random(0)
                return [
                    await _one(s, svc, name, prompts, i, rng, cancel_rate=0.0) for i in range(len(prompts))
                ]

        final = asyncio.run(after())
        assert [o.kind for o in final] == ["completed"] * len(prompts), [(o.kind, o.detail) for o in final]
        assert [o.text for o in final] == reference

        m = svc.metrics()
        preempted = sum(v for (n, _), v in m.items() if n == "pdserve_preemptions_total")
        assert preempted > 0  # the small decode pools were filled until requests were preempted
        svc.wait_idle(timeout_s=90)
    finally:
        code = svc.terminate()
    assert code == 0
