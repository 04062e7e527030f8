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

from registry.schema import connect, read_workers

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


def _until_both_workers_listed(base: str) -> None:
    """Until the router (behind ``base``) sees the prefill and the decode worker register."""
    deadline = time.monotonic() + 30
    while True:
        code, health = _get(base, "/health")
        if code == 200 and health["prefill_workers"] == 1 and health["decode_workers"] == 1:
            return
        assert time.monotonic() < deadline, health
        time.sleep(0.1)


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


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
        _until_both_workers_listed(base)
        yield base, p, d
    finally:
        _stop(procs)


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

    asyncio.run(all_free(p, d))


async def all_free(*workers) -> None:
    """Until every worker runs nothing and has all its blocks free (15 s at most)."""
    deadline = time.monotonic() + 15
    while True:
        states = [await state(w.address, w.role) for w in workers]
        if all(s.stats.num_free_blocks == s.stats.num_blocks and s.stats.num_running == 0 for s in states):
            return
        assert time.monotonic() < deadline, [s.stats for s in states]
        await asyncio.sleep(0.1)


def continuation(model_dir, prompt: list[int], out: list[int]) -> str:
    """The text ``out`` adds after ``prompt`` (decoded in context, as the ingress streams it)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    full = tok.decode(prompt + out, skip_special_tokens=True)
    return full[len(tok.decode(prompt, skip_special_tokens=True)) :]


def test_completions_batch_echo_best_of_and_sampling_controls_equal_the_engine_alone(stack, tiny_llama):
    """Over real processes (disaggregated for n = 1, aggregated for n > 1): a list of prompts with
    choices indexed prompt * n + sample, echo, best_of picking the highest mean logprob, sampling
    controls, the utility endpoints; every worker's blocks free afterwards."""
    from engine import LLM, SamplingParams

    base, p, d = stack
    model = str(tiny_llama)
    llm = LLM(model, num_blocks=128, block_size=8)
    prompts = [list(range(5, 25)), [100, 7, 7, 250, 31, 31, 2, 8, 90, 12, 13]]

    def engine_texts(prompt, **kw) -> list[tuple[str, float]]:
        out = llm.generate(
            prompt, SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0, **kw), use_tqdm=False
        )
        return [
            (
                continuation(tiny_llama, prompt, c.token_ids),
                sum(next(iter(lp.values())) for lp in c.logprobs) / 8,
            )
            for c in out[0].outputs
        ]

    # Several prompts, n = 2 seeded: choice i * 2 + j is sample j of prompt i.
    req = {"model": model, "prompt": prompts, "max_tokens": 8, "n": 2, "seed": 3, "ignore_eos": True}
    code, body = _post(base, "/v1/completions", req)
    assert code == 200, body
    want = [t for pr in prompts for t, _ in engine_texts(pr, n=2, seed=3, temperature=1.0)]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == want
    assert (
        body["usage"]["prompt_tokens"] == sum(map(len, prompts)) and body["usage"]["completion_tokens"] == 32
    )
    # The same streamed: every choice's chunks join to its text; one usage chunk for the request.
    events = _stream(
        base, "/v1/completions", {**req, "stream": True, "stream_options": {"include_usage": True}}, {}
    )
    texts = {}
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert [texts[i] for i in range(4)] == want
    assert [e["usage"]["completion_tokens"] for e in events if e.get("usage")] == [32]

    # echo: the prompt's text first (a token-id prompt decoded).
    code, body = _post(
        base, "/v1/completions", {**req, "prompt": prompts[1], "n": 1, "echo": True, "temperature": 0}
    )
    greedy = engine_texts(prompts[1], temperature=0)[0][0]
    echoed = llm.tokenizer.decode(prompts[1], skip_special_tokens=True)  # as the output is decoded
    assert body["choices"][0]["text"] == echoed + greedy
    prompt_text = llm.tokenizer.decode(prompts[1])  # /detokenize keeps special tokens, as vLLM's

    # best_of = 4: the sample with the highest mean token logprob; usage counts all four. The seed is
    # one whose best sample is not the first, so returning the first would fail.
    for seed in range(3, 40):
        samples = engine_texts(prompts[0], n=4, seed=seed, temperature=1.5)
        best = max(range(4), key=lambda j: samples[j][1])
        if best != 0:
            break
    code, body = _post(
        base,
        "/v1/completions",
        {**req, "prompt": prompts[0], "n": 1, "best_of": 4, "seed": seed, "temperature": 1.5},
    )
    assert code == 200, body
    assert [c["text"] for c in body["choices"]] == [samples[best][0]]
    assert body["choices"][0]["logprobs"] is None and body["usage"]["completion_tokens"] == 32

    # Sampling controls through prefill and decode processes equal the engine alone.
    controls = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3, min_tokens=4)
    code, body = _post(
        base,
        "/v1/completions",
        {**req, "prompt": prompts[1], "n": 1, "temperature": 0, "logit_bias": {"77": 3.0}, **controls},
    )
    assert (
        body["choices"][0]["text"]
        == engine_texts(prompts[1], temperature=0, logit_bias={77: 3.0}, **controls)[0][0]
    )

    # prompt_logprobs (vLLM's field): computed by the prefill worker (n = 1) or, aggregated, by the
    # decode worker (n = 2), equal to the engine alone's.
    ref = llm.generate(
        prompts[0], SamplingParams(max_tokens=2, prompt_logprobs=2, temperature=0), use_tqdm=False
    )
    ref_plp = ref[0].prompt_logprobs
    for n in (1, 2):
        code, body = _post(
            base,
            "/v1/completions",
            {**req, "prompt": prompts[0], "n": n, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2},
        )
        assert code == 200, body
        for c in body["choices"]:
            plp = c["prompt_logprobs"]
            assert plp[0] is None and len(plp) == len(prompts[0])
            for pos in range(1, len(plp)):
                got = {int(t): v["logprob"] for t, v in plp[pos].items()}
                assert set(got) == set(ref_plp[pos]) and next(iter(got)) == prompts[0][pos]
                assert all(abs(got[t] - ref_plp[pos][t]) < 1e-4 for t in got)
    # echo with logprobs: the prompt's tokens lead the lists (the first without a logprob).
    code, body = _post(
        base,
        "/v1/completions",
        {**req, "prompt": prompts[1], "n": 1, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1},
    )
    assert code == 200, body
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(prompts[1]) + 3 and lp["token_logprobs"][0] is None
    assert "".join(lp["tokens"]) == body["choices"][0]["text"]
    assert all(body["choices"][0]["text"][o:].startswith(t) for t, o in zip(lp["tokens"], lp["text_offset"]))
    # Each top_logprobs holds the k best and the token itself (OpenAI: up to logprobs + 1).
    for t, v, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert top[t] == v and 1 <= len(top) <= 2

    # A stop token ends a choice with its id as stop_reason, a number (vLLM's API), as the engine
    # alone ends it: through prefill and decode processes (n = 1) and aggregated (n = 2).
    greedy = llm.generate(
        prompts[1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False
    )
    tokens = greedy[0].outputs[0].token_ids
    stop_id = next(t for i, t in enumerate(tokens) if i >= 2 and t not in tokens[:i])
    ref = llm.generate(
        prompts[1], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop_id]), use_tqdm=False
    )[0].outputs[0]
    assert (ref.finish_reason, ref.stop_reason) == ("stop", stop_id)
    for n in (1, 2):
        code, body = _post(
            base,
            "/v1/completions",
            {**req, "prompt": prompts[1], "n": n, "temperature": 0, "stop_token_ids": [stop_id]},
        )
        assert code == 200, body
        for c in body["choices"]:
            assert (c["finish_reason"], c["stop_reason"]) == ("stop", stop_id)
            # The stop token ends the text without its own (vLLM's rule), as the engine alone's.
            assert c["text"] == ref.text == continuation(tiny_llama, prompts[1], ref.token_ids[:-1])

    # The utility endpoints answer from the ingress's tokenizer.
    code, body = _post(
        base, "/tokenize", {"model": model, "prompt": prompt_text, "add_special_tokens": False}
    )
    assert code == 200 and body["tokens"] == llm.tokenizer.encode(prompt_text, add_special_tokens=False)
    code, body = _post(base, "/detokenize", {"model": model, "tokens": prompts[1]})
    assert code == 200 and body["prompt"] == prompt_text

    asyncio.run(all_free(p, d))


@pytest.fixture
def router_inside(workers, redis_server, tiny_llama):
    """``python -m ingress --redis-url``: the router in the HTTP process (as ``pdserve serve``'s
    router replicas serve HTTP), in front of a prefill worker (its calls on its socket, the default)
    and a decode worker with ``--no-socket-streams`` (its calls over gRPC); no router process."""
    url = redis_server.url
    p = workers("prefill", "--redis-url", url, "--worker-id", "p1")
    d = workers("decode", "--redis-url", url, "--worker-id", "d1", "--no-socket-streams")
    ingress, address = _spawn("ingress", "--model", str(tiny_llama), "--redis-url", url, "--port", "0")
    try:
        base = f"http://{address}"
        _until_both_workers_listed(base)
        yield base, p, d
    finally:
        _stop([ingress])


def test_the_router_inside_the_http_process_serves_what_hf_computes(
    router_inside, redis_server, tiny_llama, hf_greedy
):
    """Completions, streamed and not, equal HF's greedy output through a router running in the
    ingress's process; prefills go to the prefill worker; bad input is a 400; blocks end free. The
    prefill worker registered its call-stream socket (on its own loopback host), the decode worker
    started with ``--no-socket-streams`` none, and both kinds of stream carry the requests."""
    base, p, d = router_inside
    records = read_workers(connect(redis_server.url))
    assert records["p1"].streams.startswith("127.0.0.1:") and records["p1"].streams != records["p1"].address
    assert records["d1"].streams == ""
    model = str(tiny_llama)
    for prompt in (list(range(5, 25)), [100, 7, 7, 250, 31]):
        want = continuation(tiny_llama, prompt, hf_greedy(tiny_llama, prompt, 8))
        req = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        code, body = _post(base, "/v1/completions", req, {"x-pdserve-debug": "timing"})
        assert code == 200, body
        assert body["choices"][0]["text"] == want
        assert {"route", "prefill_compute", "kv_transfer", "ttft"} <= set(body["pdserve_timing"])
        events = _stream(base, "/v1/completions", req | {"stream": True}, {})
        assert "".join(c["text"] for e in events for c in e["choices"]) == want
        # Again, ended by a stop string in its text (the ingress ends it, before the worker's
        # Finished): the prompt's cached blocks still count in usage, streamed or not.
        stop = {"stop": [want[2:5]]}
        code, body = _post(base, "/v1/completions", req | stop)
        assert body["choices"][0]["finish_reason"] == "stop", body
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == len(prompt) // 8 * 8, body["usage"]  # its whole blocks (the workers' size: 8)
        streamed = req | stop | {"stream": True, "stream_options": {"include_usage": True}}
        events = _stream(base, "/v1/completions", streamed, {})
        assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    code, body = _post(base, "/v1/completions", {"model": model, "prompt": [5, 6], "max_tokens": -3})
    assert code == 400 and body["error"]["param"] == "max_tokens"
    asyncio.run(all_free(p, d))
    assert asyncio.run(state(p.address, "prefill")).stats.prompt_tokens >= 25
