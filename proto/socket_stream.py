"""A worker's call stream over a plain TCP connection: the same batches as ``DecodeStream`` /
``PrefillStream``, framed, without gRPC's per-message cost.

Measured on this 2-core machine (``bench/README.md``, *Call streams over a socket*): with a step
every millisecond, a call stream's step cost 175-215 us less CPU at its two ends over a socket than
over gRPC (``bench.call_stream_transport``), and the short requests' stack (16 tokens in and out)
spent 18-28% less CPU per token. The call streams already send one message per engine step, but
each streamed ``grpc.aio`` message costs a C-core operation and a wake-up through gRPC's polling
thread at both ends.

A frame is a 4-byte little-endian length, then one protobuf message: ``CallStreamRequestBatch``
from the caller, ``CallStreamBatch`` from the worker. Nothing else crosses (no pickle), frames over
``MAX_FRAME_BYTES`` end the connection, and the server binds the worker's own host (loopback unless
told otherwise). The worker side runs each call through ``serve_calls`` exactly as its gRPC
``DecodeStream`` does (same handlers, validation and in-band errors). ``SocketCall`` stands in for
the ``grpc.aio`` stream-stream call that ``proto.call_stream._Stream`` reads and writes, with the
same failure: a connection that cannot be made or is lost fails every call on it with UNAVAILABLE,
so retries and migration behave as over gRPC. The caller leaving (the connection closed) cancels
every call on it, which aborts their requests, as a cancelled gRPC stream does.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from proto import pdserve_pb2 as pb
from proto.call_stream import Handler, rpc_error, serve_calls
from proto.stream_limits import MAX_MESSAGE_BYTES

logger = logging.getLogger(__name__)

MAX_FRAME_BYTES = MAX_MESSAGE_BYTES  # the senders keep under it (``proto.stream_limits``)
CONNECT_TIMEOUT_S = 20.0  # as gRPC's default connect deadline
_LEN = struct.Struct("<I")


def frame(msg) -> bytes:
    """``msg`` framed; ValueError over ``MAX_FRAME_BYTES`` (the reader would drop the connection)."""
    data = msg.SerializeToString()
    if len(data) > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {len(data)} bytes is over the limit ({MAX_FRAME_BYTES})")
    return _LEN.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader, kind: type):
    """The next message of type ``kind``, or None at a clean end of the connection; ValueError for a
    frame over the limit or bytes that are not one."""
    try:
        head = await reader.readexactly(4)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise ConnectionError("the connection ended inside a frame header") from None
        return None
    (size,) = _LEN.unpack(head)
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {size} bytes is over the limit ({MAX_FRAME_BYTES})")
    try:
        data = await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise ConnectionError("the connection ended inside a frame") from None
    try:
        return kind.FromString(data)
    except Exception as exc:  # protobuf's DecodeError: not a message of that kind
        raise ValueError(f"a frame that is no {kind.__name__}: {exc}") from None


# Worker ----------------------------------------------------------------------------------------


class CallStreamServer:
    """Serves one kind of call ("decode", "prefill") on ``host:port`` (0 picks one): each connection
    is one call stream."""

    def __init__(self, handler: Handler, kind: str, out: str = "message") -> None:
        self._handler, self._kind, self._out = handler, kind, out
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.Task] = set()
        self.address = ""

    async def start(self, host: str, port: int = 0) -> str:
        # One socket on the host's first address (a name with several would get a port on each).
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        self._server = await asyncio.start_server(self._serve, infos[0][4][0], port)
        bound = self._server.sockets[0].getsockname()[1]
        self.address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        return self.address

    async def stop(self, grace_s: float = 0.0) -> None:
        """No new connections; calls in flight get ``grace_s`` to end, then are cancelled."""
        if self._server is None:
            return
        self._server.close()
        pending = set(self._connections)
        if pending and grace_s > 0:
            await asyncio.wait(pending, timeout=grace_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        # Every connection was aborted above (3.12+ waits for them here).
        await asyncio.wait_for(self._server.wait_closed(), 5.0)
        self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            batches = serve_calls(self._handler, self._kind, self._requests(reader, task), self._out)
            async with aclosing(batches):
                async for batch in batches:
                    writer.write(frame(batch))
                    # A caller that stopped reading holds its calls back: the next batch waits, and
                    # the handlers wait once a batch's worth is unsent (``serve_calls``).
                    await writer.drain()
        except (OSError, asyncio.CancelledError):
            pass  # the caller left (its calls were cancelled with the stream) or the server stops
        except ValueError as exc:  # a batch over the frame limit: serve_calls keeps under it
            logger.error("a %s call stream ended: %s", self._kind, exc)
        finally:
            self._connections.discard(task)
            writer.transport.abort()  # nobody reads what is unsent: do not wait for it to drain

    async def _requests(
        self, reader: asyncio.StreamReader, serving: asyncio.Task
    ) -> AsyncIterator[pb.CallStreamRequestBatch]:
        """The caller's batches; at its end (or a bad frame) the stream is cancelled, and every call
        on it with it (nobody is left to read them)."""
        try:
            while (batch := await read_frame(reader, pb.CallStreamRequestBatch)) is not None:
                yield batch
        except (ConnectionError, ValueError) as exc:
            logger.info("a %s call stream ended: %s", self._kind, exc)
        except Exception as exc:  # a frame that is not a CallStreamRequestBatch
            logger.warning("a %s call stream sent an unreadable frame: %s", self._kind, exc)
        serving.cancel()


# Caller ----------------------------------------------------------------------------------------


class SocketCall:
    """A call stream to ``address`` as ``_Stream`` uses a gRPC stream-stream call: ``write``,
    ``read`` (``grpc.aio.EOF`` at the end), ``cancel``; it connects on first use."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._connected: asyncio.Future | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._cancelled = False

    async def _connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._connected is None:
            self._connected = asyncio.ensure_future(self._connect())
        try:
            return await asyncio.shield(self._connected)
        except asyncio.CancelledError:
            if self._connected.cancelled():  # ``cancel()`` ended the connect, not our caller
                raise _unavailable(self.address, "the call stream was cancelled") from None
            raise
        except Exception as exc:  # refused, unreachable, timed out, or no host:port
            raise _unavailable(self.address, f"cannot connect: {exc!r}") from None

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        host, _, port = self.address.rpartition(":")
        opening = asyncio.open_connection(host.strip("[]"), int(port), limit=1 << 20)
        reader, writer = await asyncio.wait_for(opening, CONNECT_TIMEOUT_S)
        if self._cancelled:
            writer.transport.abort()
            raise ConnectionAbortedError("cancelled")
        self._writer = writer
        return reader, writer

    async def write(self, batch: pb.CallStreamRequestBatch) -> None:
        if self._cancelled:
            raise asyncio.InvalidStateError("the call stream was cancelled")
        _, writer = await self._connection()
        try:
            writer.write(frame(batch))
            await writer.drain()
        except Exception as exc:  # reset, timed out, unreachable: the stream is gone
            raise _unavailable(self.address, repr(exc)) from None

    async def read(self):
        reader, _ = await self._connection()
        try:
            batch = await read_frame(reader, pb.CallStreamBatch)
        except Exception as exc:  # cut inside a frame, a bad frame, reset, timed out
            raise _unavailable(self.address, repr(exc)) from None
        return grpc.aio.EOF if batch is None else batch

    def cancel(self) -> bool:
        """Drop the connection now (unsent bytes too: nobody waits for them), or the connect."""
        if self._cancelled:
            return False
        self._cancelled = True
        if self._writer is not None:
            self._writer.transport.abort()
        elif self._connected is not None:
            self._connected.cancel()
        return True


def _unavailable(address: str, what: str) -> grpc.aio.AioRpcError:
    return rpc_error(grpc.StatusCode.UNAVAILABLE, f"call stream to {address}: {what}")
