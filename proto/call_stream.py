"""Many server-streaming calls on one long-lived gRPC stream, their messages batched: both ends.

Per token, a call of its own costs the sender's gRPC stack, the network and the receiver a message
each, for every request: at 32 sequences an engine step is 32 messages to the router and 32 more to
the front end. On a call stream (``DecodeWorker.DecodeStream``: a router's Decode calls to one
worker; ``PrefillWorker.PrefillStream``: its Prefill calls, one answer each; ``Router.GenerateStream``:
a front end's Generate calls to its router) the server runs each
opened call's handler exactly as a call of its own (same validation, messages, in-band errors), puts
what they produce in one outbox, and sends what the outbox holds as one ``CallStreamBatch`` whenever
it has something. An engine step wakes all its streams in one callback, so it leaves as one message;
a reader that falls behind gets larger batches, never a backlog of small ones. Batches stay under a
cap, and a reader that falls further behind holds the handlers back (``proto.stream_limits``): a
message too large for the receiver fails its own call with RESOURCE_EXHAUSTED, never the stream.

The caller's ``StreamedCall`` is what a unary-stream call object was to it: messages by
``async for``, ``cancel()`` to leave (the server cancels the handler, which aborts the request), a
deadline, and ``grpc.aio.AioRpcError`` on failure: the status the handler ended with
(``context.abort``), DEADLINE_EXCEEDED past its timeout, and the stream's own error for every call
on it when the stream breaks (the server died: UNAVAILABLE), so retry and migration rules written
for separate calls hold unchanged. A broken stream is replaced by a new one on the next open.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

import grpc

from proto import pdserve_pb2 as pb
from proto.stream_limits import BATCH_BYTES, ITEM_OVERHEAD_BYTES, MessageTooLarge, Outbox, too_large

logger = logging.getLogger(__name__)

# (request, context) -> the call's messages: a servicer's server-streaming method
Handler = Callable[[object, object], AsyncIterator[pb.GenerateResponse]]
_MESSAGES = (pb.GenerateResponse, pb.PrefillResponse)  # what a call's items carry
_CODES = {c.value[0]: c for c in grpc.StatusCode}
_END = object()  # a call's last item when it ended OK
Late = Callable[[pb.CallStreamItem], None]  # a caller's hook for items of calls it left


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


# Server ----------------------------------------------------------------------------------------


class CallAborted(Exception):
    """A handler refused or failed its call (``context.abort``): the call ends with this status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _CallContext:
    """What handlers use of a servicer context: ``abort`` ends the call, ``time_remaining``."""

    __slots__ = ("_deadline",)

    def __init__(self, timeout_s: float) -> None:
        self._deadline = time.monotonic() + timeout_s if timeout_s > 0 else None

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise CallAborted(code, details)

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())


async def serve_calls(
    handler: Handler, kind: str, requests: AsyncIterator[pb.CallStreamRequestBatch], out: str = "message"
) -> AsyncIterator[pb.CallStreamBatch]:
    """A call stream's batches, each call of ``kind`` ("decode", "generate", "prefill") run by
    ``handler``, its messages in the items' field ``out`` ("message"; "prefill": a Prefill call's
    answer), until the caller closes its side and every call has ended; the stream's end cancels
    calls still open. A batch is sent once the one before it is (``proto.stream_limits``)."""
    calls: dict[int, asyncio.Task] = {}
    outbox = Outbox(out)
    requests_done = False

    async def run(call_id: int, request, timeout_s: float) -> None:
        code, details = grpc.StatusCode.OK, ""
        try:
            # Closed when the call ends early (cancelled or refused while its handler waits at a
            # yield for room in the outbox): the handler's cleanup runs now, not when collected.
            async with aclosing(handler(request, _CallContext(timeout_s))) as messages:
                async for msg in messages:
                    if outbox.unsent >= BATCH_BYTES:  # a reader that fell behind holds them back
                        await outbox.room()
                    outbox.add(call_id, msg)
        except asyncio.CancelledError:
            return  # cancelled by its caller, or the stream ended: nobody reads an end
        except CallAborted as exc:
            code, details = exc.code, exc.details
        except MessageTooLarge as exc:  # the receiver would refuse it, and the stream with it
            code, details = grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
        except Exception as exc:  # handlers report their failures in-band; if one raises, say so
            logger.exception("call %d on a %s stream failed", call_id, kind)
            code, details = grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"
        finally:
            if calls.get(call_id) is asyncio.current_task():
                del calls[call_id]
        outbox.end(call_id, code.value[0], details)

    async def read() -> None:
        nonlocal requests_done
        try:
            async for batch in requests:
                for req in batch.requests:
                    which = req.WhichOneof("kind")
                    if which == kind and req.call_id not in calls:
                        request = getattr(req, kind)
                        calls[req.call_id] = asyncio.ensure_future(run(req.call_id, request, req.timeout_s))
                    elif which == "cancel":
                        task = calls.pop(req.call_id, None)
                        if task is not None:
                            task.cancel()
                    else:
                        logger.warning("a %s stream got a %s for call %d: ignored", kind, which, req.call_id)
        finally:
            requests_done = True
            outbox.ready.set()

    reader = asyncio.ensure_future(read())
    try:
        while True:
            taken = outbox.take()
            if taken is not None:
                yield taken[0]
                outbox.sent(taken[1])
            elif requests_done and not calls:
                return
            else:
                await outbox.ready.wait()
                outbox.ready.clear()
    finally:
        reader.cancel()
        open_calls = list(calls.values())
        for task in open_calls:
            task.cancel()
        await asyncio.gather(reader, *open_calls, return_exceptions=True)


class MultiplexedDecode:
    """``DecodeStream`` for a servicer that has ``Decode`` (the worker's, and any stand-in's)."""

    async def DecodeStream(self, request_iterator, context):
        async for batch in serve_calls(self.Decode, "decode", request_iterator):
            yield batch


class MultiplexedPrefill:
    """``PrefillStream`` for a servicer that has the unary ``Prefill`` (the worker's, and any
    stand-in's): each call's one message is the answer, and a call ends as the unary call would."""

    async def PrefillStream(self, request_iterator, context):
        async for batch in serve_calls(self.prefill_call, "prefill", request_iterator, out="prefill"):
            yield batch

    async def prefill_call(self, request, context):
        """A Prefill call on a call stream: its one message is the unary call's answer."""
        yield await self.Prefill(request, context)


class MultiplexedGenerate:
    """``GenerateStream`` for a servicer that has ``Generate`` (the router's)."""

    async def GenerateStream(self, request_iterator, context):
        async for batch in serve_calls(self.Generate, "generate", request_iterator):
            yield batch


# Caller ----------------------------------------------------------------------------------------


class StreamedCall:
    """One call on a call stream: iterate its messages; ``cancel()`` leaves it."""

    __slots__ = ("_items", "_open", "_stream", "_timer", "_waiter", "call_id")

    def __init__(self, stream: _Stream, call_id: int, timeout: float | None) -> None:
        self.call_id = call_id
        self._stream = stream
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None
        self._open = True  # neither ended, nor cancelled, nor expired
        loop = asyncio.get_running_loop()
        self._timer = None if timeout is None else loop.call_later(timeout, self._expire, timeout)

    def __aiter__(self) -> StreamedCall:
        return self

    async def __anext__(self) -> pb.GenerateResponse | pb.PrefillResponse:
        while not self._items:
            if self._waiter is not None:
                raise RuntimeError("a StreamedCall has one reader")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, _MESSAGES):
            return item
        self._items.append(item)  # the end stays: reading past it ends (or raises) again
        if item is _END:
            raise StopAsyncIteration
        raise item

    def cancel(self) -> bool:
        """Leave the call: the server cancels it (a no-op once it ended)."""
        if not self._open:
            return False
        self._finish(rpc_error(grpc.StatusCode.CANCELLED, "cancelled by the caller"))
        self._stream.send(pb.CallStreamRequest(call_id=self.call_id, cancel=True))
        return True

    async def answer(self):
        """The call's one message (a Prefill call's answer): as awaiting a unary call."""
        try:
            return await self.__anext__()
        except StopAsyncIteration:
            raise rpc_error(grpc.StatusCode.INTERNAL, "the call ended without an answer") from None

    def deliver(self, item: pb.CallStreamItem) -> None:
        which = item.WhichOneof("kind")
        if which == "message":
            self._push(item.message)
        elif which == "prefill":
            self._push(item.prefill)
        elif item.end.code == 0:
            self._finish(_END)
        else:
            self._finish(rpc_error(_CODES.get(item.end.code, grpc.StatusCode.UNKNOWN), item.end.details))

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        if self._open:
            self._finish(error)

    def _expire(self, timeout: float) -> None:
        self._timer = None
        if self._open:
            self._finish(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, f"no end within {timeout:.1f}s"))
            self._stream.send(pb.CallStreamRequest(call_id=self.call_id, cancel=True))

    def _finish(self, last) -> None:
        self._open = False
        self._stream.calls.pop(self.call_id, None)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._push(last)

    def _push(self, item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _Stream:
    """One call stream: a writer task sends opens and cancels in order (batched: whatever queued while
    a write was in flight goes out as one message, up to ``BATCH_BYTES``), a reader task hands each
    batch's items to their calls, and an item of a call no longer open (cancelled or expired: it
    crossed the cancel) to ``late``."""

    def __init__(self, call: grpc.aio.StreamStreamCall, address: str, late: Late | None = None) -> None:
        self.address = address
        self._late = late
        self.calls: dict[int, StreamedCall] = {}
        self.broken = False
        self._outgoing: asyncio.Queue[tuple[pb.CallStreamRequest, int]] = asyncio.Queue()  # with bytes
        self._call = call
        self._writer = asyncio.ensure_future(self._write())
        self._reader = asyncio.ensure_future(self._read())

    def send(self, req: pb.CallStreamRequest, size: int = ITEM_OVERHEAD_BYTES) -> None:
        """Queue ``req`` (``size``: its bytes with its overhead; a cancel's are the overhead)."""
        if not self.broken:
            self._outgoing.put_nowait((req, size))

    async def _write(self) -> None:
        try:
            outgoing = self._outgoing
            carried = None  # the request that did not fit the last write
            while True:  # what queued while the last write was in flight goes out as one message
                req, size = carried or await outgoing.get()
                batch, carried = [req], None
                while not outgoing.empty():
                    req, n = queued = outgoing.get_nowait()
                    if size + n > BATCH_BYTES:
                        carried = queued
                        break
                    batch.append(req)
                    size += n
                await self._call.write(pb.CallStreamRequestBatch(requests=batch))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            self._break(exc if isinstance(exc, grpc.aio.AioRpcError) else None)
        except Exception as exc:  # whatever else ends it, its calls fail rather than hang
            logger.warning("call stream to %s: write failed: %r", self.address, exc)
            self._break(None)

    async def _read(self) -> None:
        error = None
        try:
            while True:
                batch = await self._call.read()
                if batch is grpc.aio.EOF:
                    break
                calls = self.calls
                for item in batch.items:
                    call = calls.get(item.call_id)
                    if call is not None:
                        call.deliver(item)
                    elif self._late is not None:
                        self._late(item)
        except grpc.aio.AioRpcError as exc:
            error = exc
        except Exception as exc:  # whatever else ends it, its calls fail rather than hang
            logger.warning("call stream to %s: read failed: %r", self.address, exc)
        self._break(error)

    def _break(self, error: grpc.aio.AioRpcError | None) -> None:
        if self.broken:
            return
        self.broken = True
        if error is None:
            error = rpc_error(grpc.StatusCode.UNAVAILABLE, f"the call stream to {self.address} ended")
        if self.calls:
            logger.info(
                "call stream to %s broke (%s): %d calls fail", self.address, error.code(), len(self.calls)
            )
        for call in list(self.calls.values()):
            call.fail(error)
        self.calls.clear()
        self._call.cancel()
        self._writer.cancel()

    async def close(self) -> None:
        self._break(rpc_error(grpc.StatusCode.CANCELLED, "the caller is closing"))
        await asyncio.gather(self._writer, self._reader, return_exceptions=True)


class CallMux:
    """The calls to one server on one call stream (a new one after a break). ``open_stream``: the
    stub's stream-stream method (``stub.DecodeStream``); ``kind``: the field an open sets; ``late``:
    gets the items of calls no longer open (a Prefill answer that crossed its cancel holds KV)."""

    def __init__(
        self,
        open_stream: Callable[[], grpc.aio.StreamStreamCall],
        address: str,
        kind: str,
        late: Late | None = None,
    ) -> None:
        self._open_stream = open_stream
        self._late = late
        self.address = address
        self._kind = kind
        self._ids = itertools.count(1)
        self._stream: _Stream | None = None

    def open(self, request, timeout: float | None = None) -> StreamedCall:
        stream = self._stream
        if stream is None or stream.broken:
            stream = self._stream = _Stream(self._open_stream(), self.address, self._late)
        call = StreamedCall(stream, next(self._ids), timeout)
        stream.calls[call.call_id] = call
        req = pb.CallStreamRequest(call_id=call.call_id, timeout_s=timeout or 0.0)
        getattr(req, self._kind).CopyFrom(request)
        size = req.ByteSize() + ITEM_OVERHEAD_BYTES
        if (refused := too_large(size)) is not None:  # the server would refuse the stream it came on
            call.fail(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, refused))
        else:
            stream.send(req, size)
        return call

    @property
    def broken(self) -> bool:
        """Whether its stream broke (the server gone, or unreachable): its calls failed with
        UNAVAILABLE, unlike a call the server itself refused."""
        return self._stream is not None and self._stream.broken

    async def close(self) -> None:
        if self._stream is not None:
            await self._stream.close()
