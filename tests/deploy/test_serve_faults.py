"""``pdserve serve`` under faults: a client disconnecting mid-stream (aborted down to the workers), a
killed prefill replica, and a SIGTERM drain that leaves nothing behind. Tests run in file order
against one service of their own (a long-context model, so a request can run for minutes); the last
stops it.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import stat
import time
from pathlib import Path

import openai
import pytest
from conftest import API_KEY, GREEDY, PROMPTS, make_serve_model

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.usefixtures("blocks_back_after_each_test")]

LONG_CONTEXT = 32768
BLOCK_SIZE = 16  # the engine's default


@pytest.fixture(scope="module")
def serve_model(tmp_path_factory) -> Path:
    """conftest's tiny random Llama with a long context: thousands of tokens take minutes to decode."""
    return make_serve_model(tmp_path_factory, "serve-model-long", max_position_embeddings=LONG_CONTEXT)


@pytest.fixture(scope="module")
def serve_flags() -> tuple[str, ...]:
    return ("--num-blocks", str(LONG_CONTEXT // BLOCK_SIZE + 32))  # one request can fill the context


def _decode_generated_tokens(service) -> int:
    (decode,) = [w for w in service.status()["workers"] if w["role"] == "decode"]
    return decode["stats"]["generationTokens"]


def test_client_disconnect_mid_stream_aborts_down_to_the_workers(service, model_name):
    """Disconnected a few tokens into thousands, the request is aborted on the workers at once: all
    blocks are back long before it could have run to its end (minutes)."""

    def cancelled() -> float:
        m = service.metrics()
        return sum(
            v for (n, lab), v in m.items() if n == "pdserve_requests_total" and ("status", "cancelled") in lab
        )

    before = cancelled()
    generated_before = _decode_generated_tokens(service)
    max_tokens = LONG_CONTEXT - 64
    conn = http.client.HTTPConnection("127.0.0.1", service.port, timeout=60)
    body = {
        "model": model_name,
        "prompt": PROMPTS[1],
        "max_tokens": max_tokens,
        "stream": True,
        **GREEDY["extra_body"],
    }
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps(body),
        {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    resp = conn.getresponse()
    assert resp.status == 200
    events = 0
    while events < 3:
        if resp.readline().startswith(b"data:"):
            events += 1
    conn.sock.shutdown(2)
    conn.close()
    service.wait_idle(timeout_s=15)
    assert _decode_generated_tokens(service) - generated_before < max_tokens // 2  # aborted, not finished
    deadline = time.monotonic() + 30
    while cancelled() <= before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cancelled() == before + 1


def test_prefill_replica_killed_while_requests_run(service, model_name, tokenizer, reference):
    service.wait_workers(prefill=1, decode=1)
    prefill = service.worker_pids("prefill")  # this service's own worker: checked before it is killed
    assert len(prefill) == 1
    (victim,) = prefill
    expected = {p: reference(tokenizer.encode(p), 24)[0] for p in PROMPTS}
    aclient = openai.AsyncOpenAI(base_url=service.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

    async def one(i: int) -> tuple[str, str | None]:
        prompt = PROMPTS[i % 4] + " " + "and " * i  # distinct prompts: not all prefix hits
        try:
            r = await aclient.completions.create(model=model_name, prompt=prompt, max_tokens=24, **GREEDY)
            return prompt, r.choices[0].text
        except openai.APIStatusError as exc:
            return prompt, f"error {exc.status_code}: {exc.message}"

    def routed_to_victim() -> int:
        decisions = service.status()["cluster"]["decisions"]
        return sum(
            int(d["requests"]) for d in decisions if d["role"] == "prefill" and d["workerId"] == victim
        )

    before = routed_to_victim()

    def kill_once_prefills_wait_there() -> None:
        deadline = time.monotonic() + 120
        try:
            while routed_to_victim() <= before:
                assert time.monotonic() < deadline, "no prefill was routed to the frozen replica"
                time.sleep(0.2)
        finally:
            os.kill(prefill[victim], signal.SIGKILL)

    async def main():
        # Frozen first, so the prefills routed to it wait there, then killed once one is (not after
        # a guessed time, by which a fast machine may have finished them all).
        os.kill(prefill[victim], signal.SIGSTOP)
        killer = asyncio.create_task(asyncio.to_thread(kill_once_prefills_wait_there))
        tasks = [asyncio.create_task(one(i)) for i in range(12)]
        try:
            await killer
            return await asyncio.gather(*tasks)
        finally:
            await aclient.close()

    results = asyncio.run(main())
    ok = 0
    for prompt, got in results:
        if got.startswith("error "):
            assert "50" in got[:10], got  # a clear server-side error, never a hang
            continue
        ok += 1
        assert got == reference(tokenizer.encode(prompt), 24)[0], prompt
    assert ok >= 1
    # Serve restarts the replica; it registers as a new worker and takes traffic again.
    deadline = time.monotonic() + 120
    while True:
        workers = service.workers()
        new = [w for w in workers if w.startswith("prefill-") and w != victim]
        if new:
            break
        assert time.monotonic() < deadline, f"no new prefill worker: {workers}"
        time.sleep(1)
    client = openai.OpenAI(base_url=service.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    r = client.completions.create(model=model_name, prompt=PROMPTS[3], max_tokens=24, **GREEDY)
    assert r.choices[0].text == expected[PROMPTS[3]]
    service.wait_idle()


def test_sigterm_drains_ten_streams_and_leaves_nothing_behind(service, model_name, tokenizer, reference):
    expected = {p: reference(tokenizer.encode(p), 64)[0] for p in PROMPTS}
    record = service.record_path()
    assert record.exists() and stat.S_IMODE(record.stat().st_mode) == 0o600  # it holds the Ray token
    aclient = openai.AsyncOpenAI(base_url=service.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

    streaming: set[int] = set()
    ended_before_sigterm: list[int] = []

    async def one(i: int, prompt: str) -> str:
        stream = await aclient.completions.create(
            model=model_name, prompt=prompt, max_tokens=64, stream=True, **GREEDY
        )
        parts = []
        async for c in stream:
            parts.append(c.choices[0].text)
            streaming.add(i)
            if len(streaming) == 10 and not ended_before_sigterm:
                # The tenth stream's first token: SIGTERM now, from here (a task woken for it runs
                # when this busy loop gets to it, by which time short streams may have ended). To the
                # whole group, as timeout, systemd and Kubernetes send it (the CLI leads its group):
                # the supervisor alone gets it and hands it to the service, whose Ray cluster stays up
                # to drain.
                ended_before_sigterm.append(sum(t.done() for t in tasks))
                os.killpg(service.proc.pid, signal.SIGTERM)
        return "".join(parts)

    async def main():
        tasks.extend(asyncio.create_task(one(i, PROMPTS[i % 4])) for i in range(10))
        try:
            return await asyncio.gather(*tasks)
        finally:
            await aclient.close()

    tasks: list[asyncio.Task] = []
    texts = asyncio.run(main())
    # The signal went while streams ran (the tenth at least: it had just had its first token; the
    # first ones may have ended by then, their prompts prefilled first).
    assert len(ended_before_sigterm) == 1 and ended_before_sigterm[0] < 10
    assert texts == [expected[PROMPTS[i % 4]] for i in range(10)]  # drained, not cut
    assert service.terminate() == 0, service.output[-3000:]
    out = service.output
    drained = [line for line in out.splitlines() if "KV blocks free" in line]
    assert len(drained) == 2, out[-3000:]
    for line in drained:
        assert " 0 running, 0 waiting, 0 held" in line, line
        free, total = line.rsplit(" ", 4)[-4].split("/")
        assert free == total, line
    assert "pdserve stopped" in out
    shutdown = out[out.index("shutting down") :]
    noise = [
        x for x in shutdown.splitlines() if any(w in x.lower() for w in ("error", "failed", "traceback"))
    ]
    assert noise == [], shutdown  # a clean stop says so, nothing else
    assert not record.exists()  # removed on the way out: status no longer finds a stopped service
    deadline = time.monotonic() + 30  # Ray's processes end after the supervisor returns
    while left := service.leftover_processes():
        assert time.monotonic() < deadline, left
        time.sleep(0.2)
