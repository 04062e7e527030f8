"""The generation routes answered in plain ASGI in front of FastAPI (``ingress.asgi_routes``): a
client that leaves mid-stream cancels its request and frees its slot; a mounted app (``root_path``)
still routes them; other methods on their paths, and every other route, are FastAPI's answers."""

from __future__ import annotations

import asyncio
import json

import pytest
from asgi_client import FedRouter, Response, call, client_receive, finished, tokens

from ingress.http_app import build_http_app
from ingress.metrics import IngressMetrics
from ingress.model_info import load_model_info
from ingress.openai_serving import OpenAIServing
from ingress.options import IngressOptions

BODY = {"model": "tiny", "prompt": "the world", "max_tokens": 50, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def info(tiny_llama):
    return load_model_info(str(tiny_llama), "tiny", None, tiny=True)


class WatchedRouter(FedRouter):
    """A fed router that records when a request's stream is closed by its caller."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = asyncio.Event()

    async def generate(self, rid, prompt, params, priority, timeout_s):
        try:
            async for msg in super().generate(rid, prompt, params, priority, timeout_s):
                yield msg
        finally:
            self.closed.set()


def _serving(info, router) -> OpenAIServing:
    return OpenAIServing(info, IngressOptions(), router, IngressMetrics("tiny"))


def _app(serving):
    async def health():
        return True, {"status": "ok"}

    async def render():
        return serving.metrics.render(None, [], ("0", 0, 0))

    return build_http_app(serving, None, health, render)


def _scope(path: str, body: bytes, method: str = "POST", root_path: str = "") -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": root_path,
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }


async def _leaves_and_is_cancelled(served, left: asyncio.Event, router, serving) -> None:
    """The client goes while the router has tokens still to send: the app returns without an error,
    the router's stream is closed, the slot is free and the request counts as cancelled."""
    left.set()
    # A bound against a hang, not a duration the test expects: the app returns once the client left.
    done, _ = await asyncio.wait({served}, timeout=30)
    assert served in done and served.exception() is None  # no error because a client left
    assert router.closed.is_set()
    assert serving.admission.running == 0
    assert _cancelled(serving) == 1


def _cancelled(serving) -> float:
    text = serving.metrics.render(None, [], ("0", 0, 0)).decode()
    line = next(
        ln for ln in text.splitlines() if ln.startswith("pdserve_requests_total") and "cancelled" in ln
    )
    return float(line.rsplit(" ", 1)[1])


def test_a_client_leaving_mid_stream_cancels_its_request_and_frees_its_slot(info):
    async def run():
        router = WatchedRouter()
        serving = _serving(info, router)
        app, out, left = _app(serving), Response(), asyncio.Event()
        body = json.dumps(BODY).encode()
        receive = client_receive(body, left)

        async def send(msg):
            if msg["type"] == "http.response.start":
                out.status = msg["status"]
            elif msg.get("body"):
                out.chunks.append(msg["body"])
            out.changed.set()

        served = asyncio.ensure_future(app(_scope("/v1/completions", body), receive, send))
        router.feed.put_nowait(tokens([5]))
        router.feed.put_nowait(tokens([6]))
        await out.wait_for(lambda r: len(r.events()) >= 2)
        assert serving.admission.running == 1 and not router.closed.is_set()
        await _leaves_and_is_cancelled(served, left, router, serving)
        assert out.status == 200 and b"[DONE]" not in out.body
        assert receive.calls == 2  # the body, then one watch for the request (the stream took it over)

    asyncio.run(run())


def test_a_client_leaving_before_a_whole_answer_cancels_its_request_and_frees_its_slot(info):
    """Not streamed, nothing reaches the client before the end: a client that leaves (a timeout, a
    retry) still has its request cancelled down to the router, not generated to the end."""

    async def run():
        router = WatchedRouter()
        serving = _serving(info, router)
        app, out, left = _app(serving), Response(), asyncio.Event()
        body = json.dumps({**BODY, "stream": False}).encode()
        receive = client_receive(body, left)

        async def send(msg):
            if msg["type"] == "http.response.start":
                out.status = msg["status"]
            out.changed.set()

        served = asyncio.ensure_future(app(_scope("/v1/completions", body), receive, send))
        router.feed.put_nowait(tokens([5]))
        router.feed.put_nowait(tokens([6]))
        while not (router.feed.empty() and serving.admission.running == 1):  # both tokens taken
            await asyncio.sleep(0)
        await _leaves_and_is_cancelled(served, left, router, serving)
        assert out.status == 0  # nothing was answered

    asyncio.run(run())


def test_a_mounted_app_routes_by_the_path_under_its_root(info):
    async def run():
        router = FedRouter([tokens([5]), tokens([6]), finished()])
        app, body, out = _app(_serving(info, router)), json.dumps(BODY).encode(), Response()
        sent = False

        async def receive():  # the body, then nothing: the client stays
            nonlocal sent
            if sent:
                await asyncio.Event().wait()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(msg):
            if msg["type"] == "http.response.start":
                out.status, out.headers = msg["status"], dict(msg["headers"])
            elif msg.get("body"):
                out.chunks.append(msg["body"])

        fastapi, passed = app.app, []

        async def behind(scope, receive, send):  # what reaches FastAPI
            passed.append(scope["path"])
            await fastapi(scope, receive, send)

        app.app = behind
        await app(_scope("/llm/v1/completions", body, root_path="/llm"), receive, send)
        assert passed == []  # answered in front of FastAPI
        assert out.status == 200 and out.headers[b"content-type"].startswith(b"text/event-stream")
        assert [c["choices"][0]["finish_reason"] for c in out.events()][-1] == "length"
        assert out.body.endswith(b"data: [DONE]\n\n")

    asyncio.run(run())


def test_other_methods_and_routes_are_fastapis_answers(info):
    async def run():
        app = _app(_serving(info, FedRouter([])))
        wrong = await call(app, "/v1/completions")  # a GET
        assert wrong.status == 405 and "error" in wrong.json()
        missing = await call(app, "/v1/nowhere", {"prompt": "x"})
        assert missing.status == 404 and missing.json()["error"]["code"] == "not_found"
        models = await call(app, "/v1/models")
        assert models.status == 200 and models.json()["data"][0]["id"] == "tiny"

    asyncio.run(run())


def test_a_body_over_the_limit_is_a_413_before_the_handler(info):
    async def run():
        serving = _serving(info, FedRouter([]))
        limit = serving.options.max_body_bytes
        big = await call(_app(serving), "/v1/chat/completions", b"x" * (limit + 1))
        assert big.status == 413 and big.json()["error"]["code"] == "request_too_large"

    asyncio.run(run())


def test_fastapis_own_generation_routes_answer_as_the_front_does(info):
    """The FastAPI app behind the front keeps the generation routes (the API description, a 405 for
    other methods); reached directly, they send what the front sends, streamed and not."""

    def unstamped(obj: dict) -> dict:  # the request id and creation time differ per request
        return {k: v for k, v in obj.items() if k not in ("id", "created")}

    async def answers(stream: bool) -> list[Response]:
        outs = []
        for direct in (False, True):
            front = _app(_serving(info, FedRouter([tokens([5]), tokens([6]), finished()])))
            body = {**BODY, "max_tokens": 2, "stream": stream}
            out = await call(front.app if direct else front, "/v1/completions", body)
            assert out.status == 200, out.body
            outs.append(out)
        return outs

    async def run():
        front, fastapi = await answers(stream=True)
        assert (
            front.headers["content-type"]
            == fastapi.headers["content-type"]
            == "text/event-stream; charset=utf-8"
        )
        assert len(front.events()) >= 2
        assert [unstamped(e) for e in front.events()] == [unstamped(e) for e in fastapi.events()]
        assert front.body.endswith(b"data: [DONE]\n\n") and fastapi.body.endswith(b"data: [DONE]\n\n")
        front, fastapi = await answers(stream=False)
        assert front.headers["content-type"] == fastapi.headers["content-type"] == "application/json"
        assert unstamped(front.json()) == unstamped(fastapi.json()) and front.json()["choices"][0]["text"]

    asyncio.run(run())
