"""The other ways to run ``pdserve serve``: aggregated mode (decode replicas prefill locally; same
greedy text as HF and as disaggregated serving) with a stream interval, no API key, and the zero-setup main job
(``--demo`` on an embedded Redis-protocol server) from start to a clean exit."""

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
        serve_model, module_redis_server.url, "--mode", "aggregated", "--stream-interval", "4", api_key=None
    )
    try:
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


@pytest.mark.parametrize("http_server", ["serve_proxy", "direct"])
def test_demo_on_embedded_defaults(serve_model, http_server):
    """The zero-setup demo end to end; ``direct``: no Serve proxy runs and the ingress replica serves
    HTTP itself, so the demo's streams can only get through that server."""
    env = dict(os.environ)
    env.pop("PDSERVE_REDIS_URL", None)
    env.pop("PDSERVE_API_KEY", None)
    cmd = [sys.executable, "-m", "cli", "serve", "--model", str(serve_model), "--demo"]
    out = subprocess.run(
        [*cmd, "--port", str(free_port()), "--num-blocks", "64", "--http-server", http_server],
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


def test_router_replicas_serve_http_themselves(serve_model, module_redis_server, hf_greedy):
    """``--http-server router``: no ingress replica runs; the router replica serves the OpenAI API,
    its ingress calling the router in-process. Disaggregated output still equals HF greedy, bad input
    and a missing key still get OpenAI errors, a client that leaves mid-stream frees its blocks, and
    ``pdserve status`` reads the same router's counts."""
    svc = ServeProcess(serve_model, module_redis_server.url, "--http-server", "router")
    try:
        replicas = "\n".join(svc.leftover_processes())
        assert "pdserve:Router" in replicas and "pdserve:Ingress" not in replicas, replicas
        client = openai.OpenAI(base_url=svc.base + "/v1", api_key=svc.api_key, max_retries=0, timeout=120)
        tok = AutoTokenizer.from_pretrained(serve_model)
        name = client.models.list().data[0].id
        ids = tok.encode("the world is")
        expected = tok.decode(ids + hf_greedy(serve_model, ids, 10))[len(tok.decode(ids)) :]
        r = client.completions.create(
            model=name, prompt="the world is", max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.choices[0].text == expected
        stream = client.completions.create(
            model=name,
            prompt="the world is",
            max_tokens=10,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert "".join(c.choices[0].text for c in stream if c.choices) == expected
        left = client.completions.create(
            model=name, prompt="there was", max_tokens=200, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(left))
        left.close()  # the client goes away mid-stream: its request is aborted on the workers
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            client.completions.create(model=name, prompt="x", max_tokens=-1)
        status, _, body = svc.request("GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        health = svc.request("GET", "/health")[2]
        assert health["prefill_workers"] == 1 and health["decode_workers"] == 1
        svc.wait_idle()
        assert svc.status()["cluster"]["requestsRouted"] >= 3
    finally:
        code = svc.terminate()
    assert code == 0
    assert svc.leftover_processes() == []
