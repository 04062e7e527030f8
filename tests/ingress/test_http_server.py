"""The ingress's HTTP server turns Nagle's algorithm off on every connection it accepts: with it on,
a kept-alive connection's small SSE writes waited for the client's delayed ACK (40 ms before the
first token of every request after the first on a connection)."""

from __future__ import annotations

import asyncio
import socket

from fastapi import FastAPI

from ingress.server import serve_http


def test_accepted_connections_have_tcp_nodelay():
    async def main() -> None:
        app = FastAPI()

        @app.get("/ping")
        async def ping():
            return {"ok": True}

        http = await serve_http(app, "127.0.0.1", 0, reuse_port=False)
        try:
            host, port = http.address
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")  # kept alive: HTTP/1.1's default
            await writer.drain()
            assert (await reader.readline()).startswith(b"HTTP/1.1 200")
            connections = list(http._server.server_state.connections)
            assert len(connections) == 1
            sock = connections[0].transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
            writer.close()
        finally:
            await http.stop()

    asyncio.run(main())
