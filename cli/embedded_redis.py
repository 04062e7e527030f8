"""An embedded Redis-protocol server for zero-setup local runs (``pdserve serve`` without --redis-url).

It is fakeredis's TCP server: workers and the router reach it through the same ``redis://`` client
code as a real Redis, so nothing else changes. It holds state in this process's memory only, has no
persistence and no AUTH, and binds to loopback: it is for one machine. Production points
``--redis-url`` (or PDSERVE_REDIS_URL) at a real Redis.
"""

from __future__ import annotations

import logging
import socket
import threading

logger = logging.getLogger(__name__)


class EmbeddedRedis:
    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        from fakeredis import TcpFakeServer

        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self._server = TcpFakeServer((host, port), server_type="redis")
        self._server.daemon_threads = True  # a stuck client must not keep the process alive
        self.url = f"redis://{host}:{port}/0"
        self._thread = threading.Thread(target=self._server.serve_forever, name="embedded-redis", daemon=True)

    def start(self) -> EmbeddedRedis:
        self._thread.start()
        logger.info("embedded Redis-protocol server (fakeredis) on %s", self.url)
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
