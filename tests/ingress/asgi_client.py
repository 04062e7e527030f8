"""Driving the ingress's FastAPI app over raw ASGI, with each response body chunk seen as it is sent
(so a test can watch a stream progress), and a router stream the test feeds message by message."""

from __future__ import annotations

import asyncio
import json

from proto import pdserve_pb2 as pb


class Response:
    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.changed = asyncio.Event()

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def json(self):
        return json.loads(self.body)

    def events(self) -> list[dict]:
        lines = [ln[len(b"data: ") :] for ln in self.body.split(b"\n\n") if ln.startswith(b"data: ")]
        return [json.loads(ln) for ln in lines if ln != b"[DONE]"]

    async def wait_for(self, condition, timeout_s: float = 60) -> None:
        """Until ``condition(self)`` holds; the timeout only guards against a hang."""
        async with asyncio.timeout(timeout_s):
            while not condition(self):
                self.changed.clear()
                await self.changed.wait()


async def call(
    app,
    path: str,
    body: dict | bytes | None = None,
    headers: dict | None = None,
    out=None,
    method=None,
    root_path: str = "",
):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else b""
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method or ("POST" if body is not None else "GET"),
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": root_path,
        "query_string": b"",
        "headers": hdrs,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    receive = client_receive(raw)
    out = out or Response()

    async def send(msg):
        if msg["type"] == "http.response.start":
            out.status = msg["status"]
            out.headers = {k.decode(): v.decode() for k, v in msg["headers"]}
        elif msg["type"] == "http.response.body" and msg.get("body"):
            out.chunks.append(msg["body"])
        out.changed.set()

    await app(scope, receive, send)
    return out


class FedRouter:
    """A router whose Generate streams yield what the test puts in ``feed`` (or a fixed script)."""

    def __init__(self, script: list[pb.GenerateResponse] | None = None) -> None:
        self.script = script
        self.feed: asyncio.Queue[pb.GenerateResponse] = asyncio.Queue()

    async def generate(self, rid, prompt, params, priority, timeout_s):
        if self.script is not None:
            for m in self.script:
                yield m
            return
        while True:
            msg = await self.feed.get()
            yield msg
            if msg.WhichOneof("kind") == "finished":
                return


def client_receive(body: bytes, left: asyncio.Event | None = None):
    """ASGI ``receive`` of a client that sends ``body``, then stays, or disconnects once ``left`` is
    set; ``receive.calls`` counts the calls."""
    sent = False

    async def receive():
        nonlocal sent
        receive.calls += 1
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await (left or asyncio.Event()).wait()
        return {"type": "http.disconnect"}

    receive.calls = 0
    return receive


def tokens(ids, logprobs=None, index=0) -> pb.GenerateResponse:
    return pb.GenerateResponse(tokens=pb.TokenChunk(sample_index=index, token_ids=ids, logprobs=logprobs))


def finished(reason="length", index=0) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        finished=pb.Finished(sample_index=index, finish_reason=reason, usage=pb.Usage())
    )
