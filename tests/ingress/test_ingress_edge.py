"""The ingress's HTTP app under bad input and operations checks, driven over ASGI with a fed router:
a multi-megabyte prompt is tokenized off the event loop (a running stream keeps getting chunks
meanwhile) and then refused; out-of-range numbers are 400s naming the field, not 500s; the API
description needs the API key; token counters move once per request."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import pytest
from asgi_client import FedRouter, Response, call, finished, tokens
from prometheus_client.parser import text_string_to_metric_families

from ingress.http_app import build_http_app
from ingress.metrics import IngressMetrics
from ingress.model_info import load_model_info
from ingress.openai_serving import INLINE_BODY_BYTES, OpenAIServing
from ingress.options import IngressOptions

BODY = {"model": "tiny", "prompt": "the world", "max_tokens": 3, "temperature": 0}
CHAT_BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


@pytest.fixture(scope="module")
def info(tiny_llama):
    return load_model_info(str(tiny_llama), "tiny", None, tiny=True)


def _app(info, router, options=None, api_key=None):
    metrics = IngressMetrics("tiny")
    serving = OpenAIServing(info, options or IngressOptions(), router, metrics)

    async def health():
        return True, {"status": "ok"}

    async def render():
        return metrics.render(None, [], ("0", 0, 0))

    return build_http_app(serving, api_key, health, render)


class GatedTokenizer:
    """The real tokenizer; encoding a huge text signals ``started`` and waits for ``release``."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.started = threading.Event()
        self.release = threading.Event()

    def encode(self, text, *args, **kwargs):
        if len(text) > INLINE_BODY_BYTES:
            self.started.set()
            # Bounded so that a tokenizer running on the event loop fails the test instead of hanging.
            self.release.wait(timeout=10)
        return self.inner.encode(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_multi_megabyte_prompt_is_tokenized_off_the_loop_while_streams_flow(info):
    tok = GatedTokenizer(info.tokenizer)
    gated = replace(info, tokenizer=tok)
    prompt = "the world is " * 160_000  # ~2 MB: under the body cap, tokenized, then over the context

    async def run():
        router = FedRouter()
        app = _app(gated, router, IngressOptions(max_prompt_chars=4 << 20))
        out = Response()
        stream = asyncio.create_task(call(app, "/v1/completions", {**BODY, "stream": True}, out=out))
        await router.feed.put(tokens([5]))
        await out.wait_for(lambda r: len(r.events()) >= 1)
        big = asyncio.create_task(call(app, "/v1/completions", {**BODY, "prompt": prompt}))
        assert await asyncio.to_thread(tok.started.wait, 30)  # the big prompt is being tokenized
        # The stream answers on: its next token goes out while the tokenizer still holds the prompt.
        seen = len(out.events())
        await router.feed.put(tokens([6]))
        await out.wait_for(lambda r: len(r.events()) > seen)
        assert not big.done()
        tok.release.set()
        refused = await big
        err = refused.json()["error"]
        assert refused.status == 400, err
        assert err["param"] == "prompt" and err["code"] == "context_length_exceeded"
        await router.feed.put(tokens([7]))
        await router.feed.put(finished())
        await stream
        assert out.status == 200 and out.events()[-1]["choices"][0]["finish_reason"] == "length"

    asyncio.run(run())


@pytest.mark.parametrize(
    "path,field,value",
    [
        ("/v1/completions", "priority", 2**31),
        ("/v1/completions", "top_k", 2**31),
        ("/v1/completions", "temperature", 1e308),
        ("/v1/chat/completions", "priority", 2**63),
        ("/v1/chat/completions", "top_k", 2**31),
        ("/v1/chat/completions", "temperature", 1e308),
        ("/v1/chat/completions", "seed", 2**64),
    ],
)
def test_out_of_range_numbers_are_400s_naming_the_field(info, path, field, value):
    router = FedRouter([tokens([5]), finished()])
    body = (
        dict(BODY)
        if path == "/v1/completions"
        else {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    )
    r = asyncio.run(call(_app(info, router), path, {**body, field: value}))
    err = r.json()["error"]
    assert r.status == 400 and err["param"] == field and err["type"] == "invalid_request_error", err


def test_chat_prompt_over_the_context_is_context_length_exceeded_about_the_messages(info):
    long = " ".join(["world"] * (info.max_model_len + 10))
    body = {"model": "tiny", "messages": [{"role": "user", "content": long}]}
    r = asyncio.run(call(_app(info, FedRouter([])), "/v1/chat/completions", body))
    err = r.json()["error"]
    assert r.status == 400 and err["code"] == "context_length_exceeded" and err["param"] == "messages"


def test_the_api_description_needs_the_key_when_one_is_configured(info):
    async def run():
        app = _app(info, FedRouter([]), api_key="sesame")
        for path in ("/docs", "/openapi.json", "/redoc"):
            r = await call(app, path)
            assert r.status == 401 and r.json()["error"]["code"] == "invalid_api_key", path
            r = await call(app, path, headers={"Authorization": "Bearer wrong"})
            assert r.status == 401, path
            r = await call(app, path, headers={"Authorization": "Bearer sesame"})
            assert r.status == 200, path
        assert (
            "/v1/completions"
            in (await call(app, "/openapi.json", headers={"Authorization": "Bearer sesame"})).json()["paths"]
        )
        assert (await call(app, "/health")).status == 200  # probes need no key
        open_app = _app(info, FedRouter([]))  # no key configured: open as before
        assert (await call(open_app, "/openapi.json")).status == 200

    asyncio.run(run())


def test_a_mounted_app_asks_for_the_key_on_the_paths_it_routes(info):
    """Served under a prefix (Ray Serve sets ``root_path`` for a route_prefix other than /), the key
    check looked at the whole path, which no guarded route started: every route answered without it."""

    async def run():
        app = _app(info, FedRouter([]), api_key="sesame")
        body = {"model": "tiny", "prompt": "a"}
        for path, sent in (("/api/v1/completions", body), ("/api/tokenize", body), ("/api/version", None)):
            r = await call(app, path, sent, root_path="/api")
            assert r.status == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        r = await call(app, "/api/version", headers={"Authorization": "Bearer sesame"}, root_path="/api")
        assert r.status == 200
        assert (await call(app, "/api/health", root_path="/api")).status == 200  # probes need no key

    asyncio.run(run())


@pytest.mark.parametrize("where", ["guided_json", "tool_arguments", "deep_schema"])
def test_deeply_nested_json_in_a_field_is_a_400_or_text_not_a_500(info, where):
    """JSON nested past the parser's recursion limit inside a string field raised RecursionError (a
    500 and a traceback); a schema nested past ``MAX_DEPTH`` compiled for tens of seconds under the
    workers' one compile lock (450 levels: 10 s, every structured request there waiting)."""
    from engine.json_schema_support import MAX_DEPTH

    deep = "[" * 100_000
    if where == "guided_json":
        body, path = {"model": "tiny", "prompt": "a", "guided_json": deep}, "/v1/completions"
    elif where == "deep_schema":
        schema: dict = {"type": "string"}
        for _ in range(MAX_DEPTH + 1):
            schema = {"type": "object", "properties": {"a": schema}}
        body, path = {"model": "tiny", "prompt": "a", "guided_json": schema}, "/v1/completions"
    else:
        call_ = {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}
        messages = [
            {"role": "assistant", "content": None, "tool_calls": [call_]},
            {"role": "user", "content": "x"},
        ]
        body, path = {"model": "tiny", "messages": messages}, "/tokenize"

    async def run():
        return await call(_app(info, FedRouter([])), path, body)

    r = asyncio.run(run())
    if where == "tool_arguments":  # not JSON to the template: passed as the text it is
        assert r.status == 200, r.json()
    else:
        assert r.status == 400 and r.json()["error"]["param"] == "guided_json", r.json()
        assert ("nests subschemas more than" if where == "deep_schema" else "not valid JSON") in r.json()[
            "error"
        ]["message"]


def _counters(text: str) -> dict[str, float]:
    return {
        s.name: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name in ("pdserve_prompt_tokens_total", "pdserve_generation_tokens_total")
    }


def test_prompt_and_generation_token_counters_move_once_per_request(info):
    async def run():
        router = FedRouter([tokens([5]), tokens([6, 7]), finished()])
        app = _app(info, router)
        before = _counters((await call(app, "/metrics")).body.decode())
        assert before == {"pdserve_prompt_tokens_total": 0, "pdserve_generation_tokens_total": 0}
        prompt_len = len(info.tokenizer.encode(BODY["prompt"]))
        assert (await call(app, "/v1/completions", BODY)).status == 200
        assert (await call(app, "/v1/completions", {**BODY, "stream": True})).status == 200
        assert (
            await call(app, "/v1/completions", {**BODY, "top_k": -7})
        ).status == 400  # not sent: not counted
        after = _counters((await call(app, "/metrics")).body.decode())
        assert after == {"pdserve_prompt_tokens_total": 2 * prompt_len, "pdserve_generation_tokens_total": 6}

    asyncio.run(run())


def test_a_stop_string_inside_a_multi_token_chunk_drops_the_tokens_after_it(info):
    """A speculating worker sends several tokens at once: when the second of four completes a stop
    string, the answer's text and usage end there, as if they had come one by one."""
    ids = info.tokenizer.encode("the world is wide")
    assert len(ids) == 4
    stop_word = info.tokenizer.decode([ids[1]]).strip()

    async def run():
        router = FedRouter([tokens([ids[0]]), tokens([*ids[1:], ids[0]]), finished()])
        app = _app(info, router)
        body = {"model": "tiny", "prompt": "a", "max_tokens": 8, "stop": [stop_word]}
        resp = await call(app, "/v1/completions", body)
        assert resp.status == 200
        out = resp.json()
        (choice,) = out["choices"]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_word
        assert (
            stop_word not in choice["text"]
            and choice["text"].strip() == info.tokenizer.decode([ids[0]]).strip()
        )
        assert out["usage"]["completion_tokens"] == 2

    asyncio.run(run())


def test_a_keyed_stream_passes_the_key_check_chunk_by_chunk(info):
    """With an API key, the key check lets a streamed completion through as it is produced (each token
    reaches the client before the next is fed); a wrong or missing key, or another scheme, is a 401
    that never reaches the router."""

    async def run():
        router = FedRouter()
        app = _app(info, router, api_key="sesame")
        stream_body = {**BODY, "stream": True}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic sesame"}):
            r = await call(app, "/v1/completions", stream_body, headers=headers)
            assert r.status == 401 and r.headers["www-authenticate"] == "Bearer", headers
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert router.feed.empty()
        out = Response()
        task = asyncio.create_task(
            call(app, "/v1/completions", stream_body, headers={"Authorization": "bearer sesame"}, out=out)
        )
        for i, tok in enumerate((5, 6, 7)):
            await router.feed.put(tokens([tok]))
            await out.wait_for(lambda r, n=i + 1: len(r.events()) >= n)
        await router.feed.put(finished())
        await task
        assert out.status == 200 and out.events()[-1]["choices"][0]["finish_reason"] == "length"
        assert out.body.endswith(b"data: [DONE]\n\n")

    asyncio.run(run())


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_tokens_go_out_as_they_come_and_the_stream_ends_in_one_write(info, path):
    """Each token chunk is its own body message, sent before the next token exists; what follows the
    last sample's end (its finish, the usage chunk, [DONE]) leaves in one message, not three."""

    async def run():
        router = FedRouter()
        app = _app(info, router)
        out = Response()
        body = BODY if path == "/v1/completions" else {**CHAT_BODY, "max_tokens": 3}
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        stream = asyncio.create_task(call(app, path, body, out=out))
        for ids in ([5], [6], [7]):
            seen = len(out.chunks)
            await router.feed.put(tokens(ids))
            await out.wait_for(lambda r, seen=seen: len(r.chunks) > seen)  # out before the next is fed
        before_end = len(out.chunks)
        await router.feed.put(finished())
        await stream
        return out, before_end

    out, before_end = asyncio.run(run())
    assert len(out.chunks) == before_end + 1
    last = out.chunks[-1].split(b"\n\n")
    assert [e for e in last if e] == [last[0], last[1], b"data: [DONE]"]
    events = out.events()
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    # OpenAI: with include_usage, every other chunk carries "usage": null.
    assert all("usage" in e and e["usage"] is None for e in events[:-1])
