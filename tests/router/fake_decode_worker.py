"""A decode worker's gRPC face without an engine, registered in a real Redis, for the router's tests.

``FakeDecodeWorker.Decode`` streams one token every ``interval_s`` until the request is aborted
(then a ``finish_reason="abort"`` chunk) or the caller cancels the stream; it records what it
served, the Abort calls it received and the streams cancelled under it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from proto.call_stream import MultiplexedDecode
from registry.registration import WorkerRegistration
from registry.schema import WorkerRecord, connect


class FakeDecodeWorker(MultiplexedDecode, pb_grpc.DecodeWorkerServicer):
    def __init__(self, worker_id: str, interval_s: float = 0.02, max_tokens: int = 10_000) -> None:
        self.worker_id = worker_id
        self.interval_s = interval_s
        self.max_tokens = max_tokens
        self.served: list[str] = []  # Decode calls, by request id
        self.requests: list[pb.DecodeRequest] = []  # the Decode requests themselves
        self.aborts: list[str] = []  # Abort calls received, by request id
        self.cancelled: list[str] = []  # Decode streams the caller cancelled
        self._running: dict[str, asyncio.Event] = {}  # request id -> set on Abort
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self.registration: WorkerRegistration | None = None

    async def Decode(self, request: pb.DecodeRequest, context):
        rid = request.request_id
        aborted = self._running[rid] = asyncio.Event()
        self.served.append(rid)
        self.requests.append(request)
        ended = False
        try:
            for i in range(self.max_tokens):
                yield pb.GenerateResponse(tokens=pb.TokenChunk(token_ids=[i % 1000]))
                try:
                    await asyncio.wait_for(aborted.wait(), self.interval_s)
                except asyncio.TimeoutError:
                    continue
                ended = True
                yield pb.GenerateResponse(finished=pb.Finished(finish_reason="abort"))
                return
            ended = True
            yield pb.GenerateResponse(finished=pb.Finished(finish_reason="length"))
        finally:
            if not ended:
                self.cancelled.append(rid)
            del self._running[rid]

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        self.aborts.append(request.request_id)
        ev = self._running.get(request.request_id)
        if ev is not None:
            ev.set()
        return pb.AbortResponse(aborted=ev is not None)

    @property
    def running(self) -> list[str]:
        return list(self._running)

    async def start(self, redis_url: str, free_blocks: int = 100) -> None:
        """Serve on a free port, then register (as a real worker does: ready before routed to)."""
        self.server = grpc.aio.server()
        pb_grpc.add_DecodeWorkerServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()
        record = WorkerRecord(
            worker_id=self.worker_id,
            role="decode",
            address=self.address,
            epoch=1,
            block_size=4,
            num_blocks=100,
            num_free_blocks=free_blocks,
        )
        self.registration = WorkerRegistration(connect(redis_url), record, ttl_s=120)
        self.registration.register([])

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)


async def until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Wait (on the event loop) until ``cond()`` holds; fail saying ``what`` did not happen."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting until {what}")
        await asyncio.sleep(0.02)
