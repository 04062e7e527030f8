"""The two routes every generated token goes through, as plain ASGI in front of the FastAPI app.

``POST /v1/completions`` and ``POST /v1/chat/completions`` are answered here; every other route and
method (``/v1/models``, ``/health``, ``/metrics``, the docs, a GET on these paths) falls through to
the FastAPI app unchanged. The answers are the same as FastAPI's were (the same handlers in
``OpenAIServing``, the same body limits, headers and OpenAI-shaped errors); what is gone is the
framework on the per-token path: FastAPI's error middleware and exception wrappers around every
``send``, its routing, and Starlette's ``StreamingResponse``, which runs an anyio task group per
response to listen for the client leaving. py-spy on the standalone ingress at 16 in / 16 out, 32 in
flight: Starlette, FastAPI and anyio frames were 17% of its samples (bench/README, *The served path
on standalone processes*).

A client that leaves mid-stream cancels the stream's task (one ``receive()`` waits for
``http.disconnect``, as Starlette's listener did): the events generator closes, which cancels the
request at the router, whose worker aborts it and frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.responses import JSONResponse

from ingress.openai_protocol import APIError
from ingress.request_timing import DEBUG_HEADER, TIMING_FIELD, TIMING_HEADER, format_timing, wants_timing

logger = logging.getLogger(__name__)

# A body declared over the limit is read and dropped before the 413 when it is at most this many times
# the limit (a larger one is refused at once: reading it would cost more than a reset connection).
DRAIN_LIMIT_FACTOR = 16
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_DEBUG = DEBUG_HEADER.encode()

# (body, arrived, timing) -> a dict (non-streaming) or an async iterator of SSE bytes; APIError
Handler = Callable[[bytes, float, bool], Awaitable[dict | AsyncIterator[bytes]]]


class ClientLeft(Exception):
    """The client disconnected while its request body was being read."""


async def read_body(declared: str | None, chunks: AsyncIterator[bytes], max_body: int) -> bytes:
    """The whole body, or APIError 413 when it is over ``max_body`` bytes (declared or counted)."""
    if declared is not None and declared.isdigit() and int(declared) > max_body:
        if int(declared) <= DRAIN_LIMIT_FACTOR * max_body:
            # Read and drop it first: a 413 sent while the client still writes makes the server
            # close with unread bytes, and the client sees a connection reset, not the error.
            async for _ in chunks:
                pass
        raise APIError(413, f"request body over {max_body} bytes", code="request_too_large")
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > max_body:
            raise APIError(413, f"request body over {max_body} bytes", code="request_too_large")
        parts.append(chunk)
    return b"".join(parts)


async def _body_chunks(receive) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientLeft
        yield message.get("body", b"")
        if not message.get("more_body", False):
            return


def _header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def route_path(scope) -> str:
    """The path the app routes on: without the mount's ``root_path`` (Starlette's rule)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class GenerationRoutes:
    """ASGI: the generation routes answered here, anything else passed to ``app``."""

    def __init__(self, app, routes: dict[str, Handler], max_body: int) -> None:
        self.app, self.routes, self.max_body = app, routes, max_body

    async def __call__(self, scope, receive, send) -> None:
        handler = None
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.routes.get(route_path(scope))
        if handler is None:
            await self.app(scope, receive, send)
            return
        arrived = time.perf_counter()
        try:
            body = await read_body(_header(scope, b"content-length"), _body_chunks(receive), self.max_body)
            with _ClientWatch(receive) as watch:  # a whole answer is generated in here
                try:
                    result = await handler(body, arrived, wants_timing(_header(scope, _DEBUG)))
                except asyncio.CancelledError:
                    if not watch.left:
                        raise
                    asyncio.current_task().uncancel()
                    raise ClientLeft from None
                watch.kept = not isinstance(result, dict)  # a stream's sending goes on watching
        except ClientLeft:
            return
        except APIError as exc:
            await JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)(scope, receive, send)
            return
        except Exception:
            logger.exception("unhandled error on %s", scope["path"])
            err = APIError(500, "internal server error", code="internal")
            await JSONResponse(err.body(), status_code=500)(scope, receive, send)
            return
        await answer(result, scope, receive, send, watch)


class _ClientWatch:
    """While it is open, the current task is cancelled if the client disconnects (``left``), which
    cancels its request down to the workers (vLLM's ``with_cancellation``). ``stop()`` ends the
    watch early: after the last write the server answers ``receive()`` with a disconnect too. A
    watch ``kept`` past its ``with`` block goes on (one per request: a stream takes it over)."""

    def __init__(self, receive) -> None:
        self.left = self.kept = False
        self._watching = True
        self._task = asyncio.current_task()
        self._watcher = asyncio.ensure_future(receive())
        self._watcher.add_done_callback(self._on_message)

    def _on_message(self, watch: asyncio.Future) -> None:
        # (a callback already scheduled when the watch stopped is too late: the answer is under way)
        if not self._watching or watch.cancelled() or watch.exception() is not None:
            return
        if watch.result()["type"] == "http.disconnect":
            self.left = True
            self._task.cancel()

    def stop(self) -> None:
        self._watching = False
        self._watcher.remove_done_callback(self._on_message)
        self._watcher.cancel()

    def __enter__(self) -> _ClientWatch:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None or not self.kept:
            self.stop()


async def answer(
    result: dict | AsyncIterator[bytes], scope, receive, send, watch: _ClientWatch | None = None
) -> None:
    """A handler's answer: JSON (with the hop timing's header when it carries one), or a stream
    (watched for the client leaving by ``watch``, or a watch of its own)."""
    if isinstance(result, dict):
        timing = result.get(TIMING_FIELD)
        headers = {TIMING_HEADER: format_timing(timing)} if timing is not None else None
        await JSONResponse(result, headers=headers)(scope, receive, send)
        return
    await stream(result, receive, send, watch)


async def stream(events: AsyncIterator[bytes], receive, send, watch: _ClientWatch | None = None) -> None:
    """Send ``events`` as a streamed 200 response until they end or the client leaves."""
    watch = watch or _ClientWatch(receive)
    try:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        async for event in events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        watch.stop()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except asyncio.CancelledError:
        if not watch.left:
            raise
        asyncio.current_task().uncancel()  # the client left: the events closed (the request is cancelled)
    finally:
        watch.stop()
        await events.aclose()
