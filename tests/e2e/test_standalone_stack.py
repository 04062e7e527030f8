"""The whole request path without Ray: ``python -m prefill_worker``, ``python -m decode_worker`` and
``python -m router`` registered in a real Redis, and ``python -m ingress`` (the OpenAI HTTP layer on
its own) in front — completions over HTTP equal HF transformers, bad input gets OpenAI's error
schema, and every worker ends with all blocks free."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from pd_client import state

START_TIMEOUT_S = 120


def _spawn(module: str, *args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("LISTENING "):
            return proc, line.split()[1]
        if not line and proc.poll() is not None:
            raise RuntimeError(f"{module} exited with {proc.returncode} before serving")
    proc.kill()
    raise RuntimeError(f"{module} did not start within {START_TIMEOUT_S}s")


def _post(base: str, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(
        base + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            if "x-pdserve-timing" in resp.headers:
                return resp.status, json.loads(resp.read()) | {"header": resp.headers["x-pdserve-timing"]}
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


DISAGGREGATED_HOPS = {
    "ingress_parse",
    "ingress_queue",
    "ingress",
    "router_call",
    "route",
    "router",
    "prefill_call",
    "prefill_queue",
    "prefill_compute",
    "decode_call",
    "kv_transfer",
    "decode_queue",
    "decode_first_step",
    "ttft",
    "e2e",
}


def _stream(base: str, path: str, body: dict, headers: dict) -> list[dict]:
    req = urllib.request.Request(
        base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **headers}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        lines = [
            ln[len(b"data: ") :].strip() for ln in resp.read().split(b"\n\n") if ln.startswith(b"data: ")
        ]
    assert lines[-1] == b"[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def _get(base: str, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(base + path, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture
def stack(workers, redis_server, tiny_llama):
    url = redis_server.url
    p = workers("prefill", "--redis-url", url, "--worker-id", "p0")
    d = workers("decode", "--redis-url", url, "--worker-id", "d0")
    procs = []
    try:
        router, router_address = _spawn("router", "--redis-url", url, "--policy", "cache_aware")
        procs.append(router)
        ingress, address = _spawn(
            "ingress", "--model", str(tiny_llama), "--router", router_address, "--port", "0"
        )
        procs.append(ingress)
        base = f"http://{address}"
        deadline = time.monotonic() + 30
        while True:  # the router sees both workers once their registrations arrive
            code, health = _get(base, "/health")
            if code == 200 and health["prefill_workers"] == 1 and health["decode_workers"] == 1:
                break
            assert time.monotonic() < deadline, health
            time.sleep(0.1)
        yield base, p, d
    finally:
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_openai_http_without_ray_equals_hf(stack, tiny_llama, hf_greedy):
    base, p, d = stack
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40)]
    for prompt in prompts:
        code, body = _post(
            base,
            "/v1/completions",
            {
                "model": str(tiny_llama),
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert code == 200, body
        assert body["usage"]["completion_tokens"] == 8
        assert body["choices"][0]["text"] == continuation(
            tiny_llama, prompt, hf_greedy(tiny_llama, prompt, 8)
        )

    # Hop timing on request: every hop of the disaggregated path reports its own part.
    prompt = prompts[1]
    req = {"model": str(tiny_llama), "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    code, body = _post(base, "/v1/completions", req, {"x-pdserve-debug": "timing"})
    assert code == 200 and body["choices"][0]["text"] == continuation(
        tiny_llama, prompt, hf_greedy(tiny_llama, prompt, 8)
    )
    header = dict(item.split(";dur=") for item in body["header"].split(", "))
    assert set(header) >= DISAGGREGATED_HOPS and all(float(v) >= 0 for v in header.values())
    assert set(body["pdserve_timing"]) == set(header)
    req["stream"] = True
    events = _stream(base, "/v1/completions", req, {"x-pdserve-debug": "timing"})
    assert "".join(c["text"] for e in events for c in e["choices"]) == body["choices"][0]["text"]
    assert set(events[-1]["pdserve_timing"]) >= DISAGGREGATED_HOPS

    code, body = _post(base, "/v1/completions", {"model": str(tiny_llama), "prompt": "x", "temperature": -1})
    assert code == 400 and body["error"]["param"] == "temperature"

    async def all_free():
        deadline = time.monotonic() + 15
        while True:
            states = [await state(w.address, w.role) for w in (p, d)]
            if all(
                s.stats.num_free_blocks == s.stats.num_blocks and s.stats.num_running == 0 for s in states
            ):
                return
            assert time.monotonic() < deadline, [s.stats for s in states]
            await asyncio.sleep(0.1)

    asyncio.run(all_free())


def continuation(model_dir, prompt: list[int], out: list[int]) -> str:
    """The text ``out`` adds after ``prompt`` (decoded in context, as the ingress streams it)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    full = tok.decode(prompt + out, skip_special_tokens=True)
    return full[len(tok.decode(prompt, skip_special_tokens=True)) :]
