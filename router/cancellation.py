"""Cancellation: the requests streaming through a router, and aborting one of them wherever it is.

A request's stream is tracked (``stream``) from its start to its end; while a decode call is open,
``decoding`` knows its worker. ``abort`` asks that worker to abort it (its stream then ends with
finish reason ``abort``). A request still in prefill, between its prefill and its Decode, or whose
Decode was opened before its prefill returned (KV streaming: ``prefilling``), is aborted by the
router itself: the stream stops relaying, its worker calls are cancelled (the prefill worker aborts
the request or frees its held KV, a decode worker aborts it), and the stream ends with an ``abort``
finish of its own. A request this router does not know is asked of every decode worker (another
router replica routed it; it lives on at most one).

NOTE: the task that drives a stream is the caller's (gRPC's handler task, the ingress's). Between two
messages it is in the caller's code (gRPC sending one): a cancel landing there never reaches the
stream, and gRPC would end the call with no status (the caller hangs until its deadline). So the
task is cancelled only while it waits inside the stream; an abort that finds it in the caller's code
is taken when the caller asks for the next message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

import grpc

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from registry.schema import WorkerRecord

logger = logging.getLogger(__name__)


class _Tracked:
    """A request's stream as ``abort`` sees it: the task driving it, whether that task is inside the
    stream now (``inside``: not handed a message to the caller), and the abort's progress."""

    __slots__ = ("aborted", "cancelled", "inside", "task")

    def __init__(self, task: asyncio.Task) -> None:
        self.task = task
        self.inside = True
        self.aborted = False  # ``abort`` reached it: the stream ends with an ``abort`` finish
        self.cancelled = False  # ``abort`` cancelled its task (it was inside the stream)

    def abort(self) -> None:
        if self.aborted:
            return
        self.aborted = True
        if self.inside:  # it waits on a worker call: the cancel lands in the stream
            self.cancelled = True
            self.task.cancel()


class Cancellation:
    def __init__(self, decode_stub: Callable[[str], pb_grpc.DecodeWorkerStub]) -> None:
        self._decode_stub = decode_stub
        self._streams: dict[str, _Tracked] = {}  # request -> its stream, while it runs
        # request -> (its decode worker, the id that worker knows it by), while the call is open
        self.decoding: dict[str, tuple[WorkerRecord, str]] = {}
        self.prefilling: set[str] = set()  # requests with a Decode open, their prefill still running

    def tracks(self, request_id: str) -> bool:
        return request_id in self._streams

    async def stream(
        self, request_id: str, messages: AsyncIterator[pb.GenerateResponse], samples: int
    ) -> AsyncIterator[pb.GenerateResponse]:
        """``messages`` (a request's stream of ``samples`` samples) relayed until they end or ``abort``
        stops them; then, unless every sample had ended already, an ``abort`` finish."""
        task = asyncio.current_task()
        tracked = _Tracked(task)
        self._streams[request_id] = tracked
        ended = 0
        try:
            async with aclosing(messages):
                try:
                    async for msg in messages:
                        kind = msg.WhichOneof("kind")
                        if kind == "finished":
                            ended += 1
                        elif kind == "error":  # an in-band error ends the request
                            ended = samples
                        tracked.inside = False
                        yield msg
                        tracked.inside = True
                        if tracked.aborted:  # it came while the caller had the message
                            break
                except asyncio.CancelledError:
                    if not tracked.cancelled or task.uncancel() > 0:
                        raise  # the caller went away (too)
        finally:
            tracked.inside = False
            if self._streams.get(request_id) is tracked:
                del self._streams[request_id]
        if tracked.aborted and ended < samples:
            yield pb.GenerateResponse(finished=pb.Finished(finish_reason="abort"))

    async def abort(self, request_id: str, decode_workers: list[WorkerRecord]) -> bool:
        entry = self.decoding.get(request_id)
        if (
            entry is not None
            and request_id not in self.prefilling
            and await self._ask(entry[0], entry[1], log=True)
        ):
            return True
        tracked = self._streams.get(request_id)
        if tracked is not None and tracked.task is not asyncio.current_task():
            tracked.abort()
            return True
        # All at once: one hung worker must not hold up the answer from the others.
        return any(await asyncio.gather(*(self._ask(w, request_id) for w in decode_workers)))

    async def _ask(self, w: WorkerRecord, request_id: str, log: bool = False) -> bool:
        try:
            r = await self._decode_stub(w.address).Abort(pb.AbortRequest(request_id=request_id), timeout=5)
            return r.aborted
        except grpc.aio.AioRpcError as exc:
            if log:
                logger.info("abort of %s on %s failed (%s)", request_id, w.worker_id, exc.code())
            return False
