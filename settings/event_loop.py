"""The event loop a standalone pdserve process runs on (``python -m ingress``, ``router``,
``decode_worker``, ``prefill_worker``).

uvloop when it is installed (it comes with uvicorn's standard extras and with Ray Serve, whose
replicas run on it), else asyncio's own loop. Every streamed token crosses each process as socket
reads and writes and a few callbacks: measured on the standalone stack (``bench.served_path``, 16 in
/ 16 out), the ingress spent 0.218 ms of CPU per streamed token on asyncio's loop and 0.192 on
uvloop's. grpc.aio runs on either.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TypeVar

T = TypeVar("T")


def run(main: Coroutine[object, object, T]) -> T:
    """``main`` to its end on this loop; its result."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
