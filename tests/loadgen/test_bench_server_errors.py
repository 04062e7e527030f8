"""``pdserve bench`` against a server it cannot use says so in one line, not an aiohttp traceback: a
closed port is a ConnectionError, a key refused (401) or a wrong root a ValueError naming what to do
(``cli.main`` prints either as ``error: ...``); the URL the serve banner prints (``.../v1``) works
as the root."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest
from aiohttp import web

from loadgen.serving_client import _first_model, server_root


async def _serving(handler):
    app = web.Application()
    app.router.add_get("/v1/models", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def _first(handler, root_suffix: str = "") -> str:
    async def main():
        runner, base = await _serving(handler)
        try:
            async with aiohttp.ClientSession() as session:
                return await _first_model(session, base + root_suffix, {})
        finally:
            await runner.cleanup()

    return asyncio.run(main())


async def _models(request):
    return web.json_response({"object": "list", "data": [{"id": "tiny"}]})


async def _needs_key(request):
    return web.json_response({"error": {"message": "bad key"}}, status=401)


async def _not_a_list(request):
    return web.Response(text="<html>hello</html>")


def test_the_banners_url_and_the_root_name_the_same_server():
    assert _first(_models) == _first(_models, "/v1/") == "tiny"
    assert server_root("http://h:8000/v1/") == server_root("http://h:8000") == "http://h:8000"


def test_a_refusal_or_a_page_that_is_no_model_list_is_one_line_saying_what_to_do():
    with pytest.raises(
        ValueError, match=r"answered 401: give the server's key \(--api-key or PDSERVE_API_KEY\)"
    ):
        _first(_needs_key)
    with pytest.raises(ValueError, match="lists no model: give --model"):
        _first(_not_a_list)


def test_a_closed_port_is_a_connection_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again once the block ends: nothing listens there

    async def main():
        async with aiohttp.ClientSession() as session:
            return await _first_model(session, f"http://127.0.0.1:{port}", {})

    with pytest.raises(ConnectionError, match=f"cannot reach http://127.0.0.1:{port}/v1/models"):
        asyncio.run(main())
