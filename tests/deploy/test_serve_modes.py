"""The other ways to run ``pdserve serve``: aggregated mode (decode replicas prefill locally; same
greedy text as HF and as disaggregated serving) with a stream interval, no API key and the ingress
replica serving HTTP itself (``--http-server direct``), and the zero-setup main job (``--demo`` on an
embedded Redis-protocol server, behind Serve's proxy) from start to a clean exit. The default layout
(``--http-server router``) is tests/deploy/test_serve_api.py's service."""

from __future__ import annotations

import os
import subprocess
import sys

import openai
import pytest
from conftest import ServeProcess, free_port
from transformers import AutoTokenizer

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_aggregated_mode_matches_hf_and_n_samples(serve_model, module_redis_server, hf_greedy):
    svc = ServeProcess(
        serve_model, module_redis_server.url,
        "--mode", "aggregated", "--stream-interval", "4", "--http-server", "direct", api_key=None,
    )  # fmt: skip
    try:
        replicas = "\n".join(svc.leftover_processes())  # direct: the ingress replica serves HTTP
        assert "pdserve:Ingress" in replicas and "ProxyActor" not in replicas, replicas
        client = openai.OpenAI(base_url=svc.base + "/v1", api_key="unused", max_retries=0, timeout=120)
        tok = AutoTokenizer.from_pretrained(serve_model)
        name = client.models.list().data[0].id
        for prompt in ["the world is", "there was a man who"]:
            ids = tok.encode(prompt)
            out = hf_greedy(serve_model, ids, 10)
            expected = tok.decode(ids + out)[len(tok.decode(ids)) :]
            r = client.completions.create(
                model=name, prompt=prompt, max_tokens=10, temperature=0, n=2, extra_body={"ignore_eos": True}
            )
            assert [c.text for c in r.choices] == [expected, expected]
            assert r.usage.completion_tokens == 20
            # --stream-interval 4: the first token at once, then 4 per SSE event, the rest at the end,
            # and the finish reason in an event of its own (11 events with an interval of 1)
            stream = client.completions.create(
                model=name,
                prompt=prompt,
                max_tokens=10,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            events = [c.choices[0] for c in stream if c.choices]
            assert "".join(c.text for c in events) == expected
            assert 3 <= len(events) <= 5 and events[-1].finish_reason == "length", events
        seeded = client.completions.create(model=name, prompt="the world is", max_tokens=8, n=3, seed=7)
        again = client.completions.create(model=name, prompt="the world is", max_tokens=8, n=3, seed=7)
        assert [c.text for c in seeded.choices] == [c.text for c in again.choices]
        health = svc.request("GET", "/health")[2]
        assert health["prefill_workers"] == 0 and health["decode_workers"] == 1
        workers = svc.wait_idle()
        assert list(workers) and all(w.startswith("decode-") for w in workers)
    finally:
        code = svc.terminate()
    assert code == 0
    assert svc.leftover_processes() == []


def test_demo_on_embedded_defaults(serve_model):
    """The zero-setup demo end to end, through Serve's HTTP proxy (what KubeRay's serve Service
    routes to)."""
    env = dict(os.environ)
    env.pop("PDSERVE_REDIS_URL", None)
    env.pop("PDSERVE_API_KEY", None)
    cmd = [sys.executable, "-m", "cli", "serve", "--model", str(serve_model), "--demo"]
    out = subprocess.run(
        [*cmd, "--port", str(free_port()), "--num-blocks", "64", "--http-server", "serve_proxy"],
        capture_output=True,
        text=True,
        env=env,
        timeout=400,
        start_new_session=True,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "embedded Redis-protocol server" in out.stdout
    assert out.stdout.count("TTFT") == 4
    final = [line for line in out.stdout.splitlines() if "KV blocks free" in line]
    assert len(final) == 2 and all(" 0 running, 0 waiting, 0 held, 64/64 KV blocks free" in x for x in final)
    assert "pdserve stopped" in out.stdout
