"""The overhead benchmark's ceiling (``bench.minimal_server``) serves the same work as pdserve: its
stream is HF's greedy text with the usage and ``[DONE]``, and a client that leaves frees its blocks.
Driven as ASGI in-process: the server under test is the app, not uvicorn."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench.minimal_server import MinimalApp
from engine import LLM


@pytest.fixture(scope="module")
def app(tiny_llama):
    app = MinimalApp(LLM(str(tiny_llama), num_blocks=64, block_size=4), "minimal")
    app.loop.start()
    yield app
    app.loop.stop()


def _scope(path: str, method: str = "POST") -> dict:
    return {"type": "http", "path": path, "method": method, "headers": []}


async def _call(app, path, body: dict, *, leave_after: int | None = None) -> list[dict]:
    """The app's messages; with ``leave_after`` the client disconnects after that many body chunks."""
    left = asyncio.Event()
    sent: list[dict] = []
    chunks = 0
    body_sent = False

    async def receive():
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(msg):
        nonlocal chunks
        sent.append(msg)
        if msg["type"] == "http.response.body":
            chunks += 1
            if not msg.get("more_body", False) or chunks == leave_after:
                left.set()

    try:
        await app(_scope(path), receive, send)
    except asyncio.CancelledError:
        assert leave_after is not None, "cancelled without a disconnect"
    return sent


def _events(sent: list[dict]) -> list[bytes]:
    data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return [e[len(b"data: ") :] for e in data.split(b"\n\n") if e]


async def _free(app) -> int:
    return (await app.loop.run(app.llm.core.stats)).num_free_blocks


def test_stream_is_hf_greedy_with_usage_and_done(app, tiny_llama, hf_greedy):
    prompt = [5, 17, 33, 2, 9, 41]

    async def run():
        free = await _free(app)
        sent = await _call(app, "/v1/completions", {"prompt": prompt, "max_tokens": 9, "ignore_eos": True})
        return free, sent, await _free(app)

    before, sent, after = asyncio.run(run())
    assert sent[0]["status"] == 200
    events = _events(sent)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    tok = app.llm.tokenizer
    expected = tok.decode(prompt + hf_greedy(tiny_llama, prompt, 9))[len(tok.decode(prompt)) :]
    assert text == expected
    assert chunks[-1]["usage"] == {"prompt_tokens": 6, "completion_tokens": 9, "total_tokens": 15}
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert after == before


def test_a_client_that_leaves_aborts_its_request(app):
    async def run():
        start = await app.loop.run(app.llm.core.stats)
        body = {"prompt": [3, 4, 5, 6, 7], "max_tokens": 200, "ignore_eos": True}
        sent = await _call(app, "/v1/completions", body, leave_after=2)
        deadline = asyncio.get_running_loop().time() + 60
        while (end := await app.loop.run(app.llm.core.stats)).num_running or end.num_waiting:
            assert asyncio.get_running_loop().time() < deadline, (
                "the request still runs after its client left"
            )
            await asyncio.sleep(0.01)
        return sent, start, end

    sent, start, end = asyncio.run(run())
    chunks = [m for m in sent if m["type"] == "http.response.body"]
    # It left mid-stream, not at the end: after the second chunk, the stream may send what it
    # already had before its disconnect watch runs (one run sent 6), never the whole answer.
    assert 2 <= len(chunks) < 100 and chunks[-1]["more_body"]
    assert end.num_free_blocks == start.num_free_blocks
    assert end.generation_tokens - start.generation_tokens < 200  # aborted, not run to its end


def test_models_and_unknown_paths(app):
    sent = asyncio.run(_call(app, "/v1/models", {}))
    assert json.loads(sent[1]["body"])["data"][0]["id"] == "minimal"
    sent = asyncio.run(_call(app, "/v1/chat/completions", {}))
    assert sent[0]["status"] == 404
