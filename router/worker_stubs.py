"""The router's connections to its workers: one channel per worker address, its stubs made once, one
``DecodeStream`` per decode worker carrying all Decode calls to it and one ``PrefillStream`` per
prefill worker carrying all Prefill calls to it. A Prefill answer that arrives after its call was
left (the caller went away or it expired while the answer was on its way: the worker holds its KV)
goes to ``late_prefill``.

A generated stub builds a callable for every method of its service when it is constructed, so one
made per request cost the router ~0.1 ms of CPU per request for nothing; these are kept for the
router's lifetime, as the channels are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import grpc

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from proto.call_stream import CallMux, rpc_error
from proto.socket_stream import SocketCall
from proto.stream_limits import grpc_options
from registry.schema import WorkerRecord


class WorkerStubs:
    def __init__(self, late_prefill: Callable[[pb.PrefillResponse], None] | None = None) -> None:
        self._late_prefill = late_prefill
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._prefill: dict[str, pb_grpc.PrefillWorkerStub] = {}
        self._decode: dict[str, pb_grpc.DecodeWorkerStub] = {}
        self._streams: dict[str, CallMux] = {}
        self._prefill_streams: dict[str, CallMux] = {}
        self._closed = False  # once closed, no call stream is opened again (a relay still running fails)

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = grpc.aio.insecure_channel(address, options=grpc_options())
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

    def decode_stream(self, worker: WorkerRecord) -> CallMux:
        """The worker's Decode calls, all on one call stream (``proto.call_stream``): over its socket
        when it serves one (``proto.socket_stream``), else its gRPC ``DecodeStream``."""
        return self._mux(self._streams, worker, "decode", lambda: self.decode(worker.address).DecodeStream)

    def prefill_stream(self, worker: WorkerRecord) -> CallMux:
        """The worker's Prefill calls, all on one call stream as ``decode_stream``'s (a unary gRPC
        call each cost the router and the worker a call's setup per request)."""
        return self._mux(
            self._prefill_streams,
            worker,
            "prefill",
            lambda: self.prefill(worker.address).PrefillStream,
            self._late if self._late_prefill is not None else None,
        )

    def _late(self, item: pb.CallStreamItem) -> None:
        if item.WhichOneof("kind") == "prefill":
            self._late_prefill(item.prefill)

    def _mux(
        self, muxes: dict[str, CallMux], worker: WorkerRecord, kind: str, grpc_stream, late=None
    ) -> CallMux:
        self._check_open()
        key = worker.streams or worker.address
        mux = muxes.get(key)
        if mux is None:
            opener = functools.partial(SocketCall, worker.streams) if worker.streams else grpc_stream()
            mux = muxes[key] = CallMux(opener, key, kind, late)
        return mux

    def _check_open(self) -> None:
        if self._closed:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "the router is closing")

    async def close(self) -> None:
        self._closed = True
        for mux in [*self._streams.values(), *self._prefill_streams.values()]:
            await mux.close()
        for ch in self._channels.values():
            await ch.close()
