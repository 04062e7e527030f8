"""How large a call stream's messages may be, at both ends and over both transports.

A receiver refuses a message over its limit by ending the whole stream (gRPC fails the stream with
RESOURCE_EXHAUSTED, the socket drops the connection), and every call on the stream fails with it. So
the senders keep under the limit. ``proto.call_stream``'s server and caller send batches of at most
``BATCH_BYTES``, unless one message alone is larger; then that message travels in a batch of its
own. The server's handlers wait while ``BATCH_BYTES`` of their messages are unsent, so a reader that
falls behind holds its calls back instead of growing the server's memory. A single message over
``MAX_MESSAGE_BYTES`` ends only its own call, with RESOURCE_EXHAUSTED. Every gRPC channel and server
that carries call streams accepts ``MAX_MESSAGE_BYTES`` (``grpc_options()``); gRPC's default
receive limit is 4 MiB.
"""

from __future__ import annotations

import asyncio
from collections import deque

from proto import pdserve_pb2 as pb

MAX_MESSAGE_BYTES = 64 << 20  # the largest batch a receiver takes: a socket frame, a gRPC message
BATCH_BYTES = 2 << 20  # what a sender puts in one batch, and what a server buffers before it waits
# The item's and the batch's fields around one message: call id, field tags and lengths.
ITEM_OVERHEAD_BYTES = 32


def grpc_options() -> list[tuple[str, int]]:
    """The options of a gRPC channel or server that carries call streams (``grpc.aio.server(options=...)``,
    ``grpc.aio.insecure_channel(address, options=...)``)."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ]


def too_large(size: int) -> str | None:
    """Why one message of ``size`` bytes (its item's overhead included) cannot travel, or None."""
    if size <= MAX_MESSAGE_BYTES:
        return None
    return f"a message of {size} bytes is over the call stream's limit ({MAX_MESSAGE_BYTES} bytes)"


class MessageTooLarge(Exception):
    """One message over ``MAX_MESSAGE_BYTES``: its call fails (RESOURCE_EXHAUSTED), not the stream."""


class Outbox:
    """A call stream's unsent items, in batches of at most ``BATCH_BYTES`` (a larger message in a
    batch of its own). ``put`` waits while ``BATCH_BYTES`` are unsent (the batch being sent
    included), so a reader that falls behind holds its calls back; a call's end never waits."""

    def __init__(self, out: str) -> None:
        self._out = out
        self._full: deque[tuple[pb.CallStreamBatch, int]] = deque()  # batches closed, oldest first
        self._open: pb.CallStreamBatch | None = None  # the batch items go into, after those
        self._open_bytes = 0
        self.unsent = 0  # bytes in the batches and in the batch being sent
        self.ready = asyncio.Event()  # something to send, or a change the sender must see
        self._room = asyncio.Event()

    async def put(self, call_id: int, msg) -> None:
        """``add``, once there is room."""
        if self.unsent >= BATCH_BYTES:
            await self.room()
        self.add(call_id, msg)

    async def room(self) -> None:
        """Until fewer than ``BATCH_BYTES`` are unsent."""
        while self.unsent >= BATCH_BYTES:
            self._room.clear()
            await self._room.wait()

    def add(self, call_id: int, msg) -> None:
        """``msg`` into the outbox now (``MessageTooLarge`` past the limit). NOTE: every message of
        every call (a caller that checks ``unsent`` first saves an awaited call per message)."""
        size = msg.ByteSize() + ITEM_OVERHEAD_BYTES
        if size > MAX_MESSAGE_BYTES:
            raise MessageTooLarge(too_large(size))
        # The message is copied once, into the batch (an item built apart and then the batch from
        # the items copied it twice, 2.5 us a message against 0.7).
        getattr(self._item(call_id, size), self._out).CopyFrom(msg)

    def end(self, call_id: int, code: int, details: str) -> None:
        """The call's last item: its status (a ``grpc.StatusCode`` value) and details."""
        end = self._item(call_id, len(details) + ITEM_OVERHEAD_BYTES).end
        end.code, end.details = code, details

    def _item(self, call_id: int, size: int) -> pb.CallStreamItem:
        batch, held = self._open, self._open_bytes
        if batch is None or (held and held + size > BATCH_BYTES):
            if batch is not None:
                self._full.append((batch, held))
            batch = self._open = pb.CallStreamBatch()
            held = 0
        self._open_bytes = held + size
        self.unsent += size
        self.ready.set()
        return batch.items.add(call_id=call_id)

    def take(self) -> tuple[pb.CallStreamBatch, int] | None:
        """The next batch to send and its bytes (``sent`` with them once it is sent), or None."""
        if self._full:
            return self._full.popleft()
        if self._open is None:
            return None
        taken = (self._open, self._open_bytes)
        self._open, self._open_bytes = None, 0
        return taken

    def sent(self, size: int) -> None:
        self.unsent -= size
        self._room.set()
