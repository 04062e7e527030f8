"""A fake OpenAI-compatible server for driving ``pdserve bench`` end to end: it lists one model,
streams two tokens for every completion and records each prompt in the order the requests came.
It runs on an event loop of its own in a thread, as ``pdserve bench`` runs one loop per level."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field

import pytest
from aiohttp import web


@dataclass
class FakeServer:
    base_url: str = ""
    prompts: list[str | list[int]] = field(default_factory=list)  # in arrival order

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.prompts.append(body["prompt"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 2}
        for event in (
            {"choices": [{"text": "a"}]},
            {"choices": [{"text": "b"}]},
            {"choices": [], "usage": usage},
        ):
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.fixture
def fake_server():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = FakeServer()

    async def start() -> web.AppRunner:
        runner = web.AppRunner(server.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        server.base_url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return runner

    runner = asyncio.run_coroutine_threadsafe(start(), loop).result()
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
