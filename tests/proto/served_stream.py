"""A servicer's call stream served over a real transport for the tests of ``proto.call_stream``: a
gRPC server and channel built as the router's and the workers' are (``proto.stream_limits``), or the
worker's plain socket (``proto.socket_stream``)."""

from __future__ import annotations

import asyncio

import grpc

from proto import pdserve_pb2_grpc as pb_grpc
from proto.call_stream import CallMux
from proto.socket_stream import CallStreamServer, SocketCall
from proto.stream_limits import grpc_options

TRANSPORTS = ("grpc", "socket")


class Served:
    """A servicer served over ``transport``; ``mux`` reaches it, ``stop()`` takes the server away."""

    def __init__(self, servicer, transport: str, kind: str = "decode") -> None:
        self.servicer, self.transport, self.kind = servicer, transport, kind
        self.server = self.channel = self.calls = None

    async def start(self) -> Served:
        if self.transport == "socket":
            if self.kind == "decode":
                self.calls = CallStreamServer(self.servicer.Decode, "decode")
            else:
                self.calls = CallStreamServer(self.servicer.prefill_call, "prefill", out="prefill")
            address = await self.calls.start("127.0.0.1")
            self.mux = CallMux(lambda: SocketCall(address), address, self.kind)
            return self
        self.server = grpc.aio.server(options=grpc_options())
        if self.kind == "decode":
            pb_grpc.add_DecodeWorkerServicer_to_server(self.servicer, self.server)
        else:
            pb_grpc.add_PrefillWorkerServicer_to_server(self.servicer, self.server)
        address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(address, options=grpc_options())
        stub = (pb_grpc.DecodeWorkerStub if self.kind == "decode" else pb_grpc.PrefillWorkerStub)(
            self.channel
        )
        self.mux = CallMux(
            stub.DecodeStream if self.kind == "decode" else stub.PrefillStream, address, self.kind
        )
        return self

    async def stop(self) -> None:
        if self.calls is not None:
            await self.calls.stop()
        if self.server is not None:
            await self.server.stop(0)

    async def close(self) -> None:
        await self.mux.close()
        if self.channel is not None:
            await self.channel.close()
        await self.stop()


async def until(cond, what: str) -> None:
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


async def collect(call) -> list:
    return [msg async for msg in call]
