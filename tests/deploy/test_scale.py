"""``pdserve scale`` on a running service: prefill scales 1 -> 2 (the new replica registers and takes
traffic) and back 2 -> 1 while streams run (the removed replica drains; no request is lost)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import openai
import pytest
from conftest import API_KEY, ServeProcess
from transformers import AutoTokenizer

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPTS = ["the world is", "there was a man who", "in the first years", "what people know about"]


def prefill_workers(svc: ServeProcess) -> set[str]:
    return {w for w in svc.workers() if w.startswith("prefill-")}


def wait_for(svc: ServeProcess, count: int, timeout_s: float = 180) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while len(workers := prefill_workers(svc)) != count:
        assert time.monotonic() < deadline, f"expected {count} prefill workers, have {workers}"
        time.sleep(0.5)
    return workers


def test_scale_prefill_up_and_down_under_load(serve_model, module_redis_server, hf_greedy):
    svc = ServeProcess(serve_model, module_redis_server.url, "--policy", "round_robin", "--ray-cpus", "8")
    tok = AutoTokenizer.from_pretrained(serve_model)

    def expected(prompt: str, n: int) -> str:
        ids = tok.encode(prompt)
        return tok.decode(ids + hf_greedy(serve_model, ids, n))[len(tok.decode(ids)) :]

    async def streams(name: str, prompts: list[str], n: int, until=None) -> list[tuple[str, str]]:
        """(prompt, text) of greedy streams of ``prompts``; with ``until`` (a task), rounds of them
        go on until that task is done (and one more round after it)."""
        client = openai.AsyncOpenAI(base_url=svc.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

        async def one(p):
            s = await client.completions.create(
                model=name,
                prompt=p,
                max_tokens=n,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            return p, "".join([c.choices[0].text async for c in s])

        try:
            out = list(await asyncio.gather(*(one(p) for p in prompts)))
            while until is not None:
                done = until.done()
                out += await asyncio.gather(*(one(p) for p in prompts))
                if done:
                    await until
                    break
            return out
        finally:
            await client.close()

    try:
        name = svc.request("GET", "/v1/models")[2]["data"][0]["id"]
        svc.wait_workers(prefill=1, decode=1)
        (first,) = wait_for(svc, 1)
        # No room for 40 more replicas of 1 CPU on this 8-CPU cluster: refused with the reason, not
        # left pending without a word (the replica's reservation read from the running service).
        refused = subprocess.run(
            [sys.executable, "-m", "cli", "scale", "--service", svc.name, "--prefill", "41"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert refused.returncode == 2 and "Prefill: 1 -> 41 replicas needs 40 CPU" in refused.stderr
        assert "--ray-cpus" in refused.stderr
        out = svc.cli("scale", "--prefill", "2")  # --service: this test's service, whatever else runs
        assert f"scaling service {svc.name!r}" in out and "Prefill: 1 -> 2 replicas" in out
        workers = wait_for(svc, 2)
        assert first in workers  # the running replica was untouched (no redeploy)
        prompts = [p + " " + "and " * i for i, p in enumerate(PROMPTS * 2)]
        texts = asyncio.run(streams(name, prompts, 12))
        assert texts == [(p, expected(p, 12)) for p in prompts]
        status = svc.cli("status")
        assert status.startswith(f"service {svc.name!r} (endpoint {svc.base}")
        assert all(w in status for w in workers)  # both registered and visible to operators
        assert "replicas running/target: " in status and "Prefill 2/2" in status, status

        # Scale down under traffic: rounds of 8 streams go on from before the command until after the
        # removed replica is gone (not for a guessed time); every stream completes with the right text.
        async def scale_down() -> None:
            await asyncio.to_thread(svc.cli, "scale", "--prefill", "1")
            await asyncio.to_thread(wait_for, svc, 1)

        async def under_traffic() -> list[tuple[str, str]]:
            return await streams(name, prompts, 48, until=asyncio.create_task(scale_down()))

        want = {p: expected(p, 48) for p in prompts}
        texts = asyncio.run(under_traffic())
        assert len(texts) >= 2 * len(prompts) and texts == [(p, want[p]) for p, _ in texts]
        assert len(prefill_workers(svc)) == 1
        svc.wait_idle()
    finally:
        assert svc.terminate() == 0
