"""The router's connections to its workers: one channel per worker address, its stubs made once, one
``DecodeStream`` per decode worker carrying all Decode calls to it and one ``PrefillStream`` per
prefill worker carrying all Prefill calls to it.

A generated stub builds a callable for every method of its service when it is constructed, so one
made per request cost the router ~0.1 ms of CPU per request for nothing; these are kept for the
router's lifetime, as the channels are.
"""

from __future__ import annotations

import grpc

from proto import pdserve_pb2_grpc as pb_grpc
from proto.call_stream import CallMux


class WorkerStubs:
    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._prefill: dict[str, pb_grpc.PrefillWorkerStub] = {}
        self._decode: dict[str, pb_grpc.DecodeWorkerStub] = {}
        self._streams: dict[str, CallMux] = {}
        self._prefill_streams: dict[str, CallMux] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = grpc.aio.insecure_channel(address)
        return ch

    def prefill(self, address: str) -> pb_grpc.PrefillWorkerStub:
        stub = self._prefill.get(address)
        if stub is None:
            stub = self._prefill[address] = pb_grpc.PrefillWorkerStub(self.channel(address))
        return stub

    def decode(self, address: str) -> pb_grpc.DecodeWorkerStub:
        stub = self._decode.get(address)
        if stub is None:
            stub = self._decode[address] = pb_grpc.DecodeWorkerStub(self.channel(address))
        return stub

    def decode_stream(self, address: str) -> CallMux:
        """The worker's Decode calls, all on one ``DecodeStream`` (``proto.call_stream``)."""
        mux = self._streams.get(address)
        if mux is None:
            mux = self._streams[address] = CallMux(self.decode(address).DecodeStream, address, "decode")
        return mux

    def prefill_stream(self, address: str) -> CallMux:
        """The worker's Prefill calls, all on one ``PrefillStream``: a unary call each cost the router
        and the worker a gRPC call's setup per request."""
        mux = self._prefill_streams.get(address)
        if mux is None:
            mux = CallMux(self.prefill(address).PrefillStream, address, "prefill")
            self._prefill_streams[address] = mux
        return mux

    async def close(self) -> None:
        for mux in [*self._streams.values(), *self._prefill_streams.values()]:
            await mux.close()
        for ch in self._channels.values():
            await ch.close()
