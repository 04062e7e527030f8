"""Cancellation: the requests streaming through a router, and aborting one of them wherever it is.

A request is ``track``ed from the moment its Generate stream starts until it ends; while a decode
call is open, ``decoding`` knows its worker. ``abort`` asks that worker to abort it (its stream then
ends with finish reason ``abort``); a request still in prefill has its stream's task cancelled (which
cancels the prefill call and releases any KV held for it), and its handler, asking ``take_aborted``,
ends the stream normally with ``abort``; so has a request whose Decode was opened before its prefill
(KV streaming) until the prefill returns (``prefilling``). A request this router does not know is
asked of every decode worker (another router replica routed it; it lives on at most one).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable

import grpc

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from registry.schema import WorkerRecord

logger = logging.getLogger(__name__)


class Cancellation:
    def __init__(self, decode_stub: Callable[[str], pb_grpc.DecodeWorkerStub]) -> None:
        self._decode_stub = decode_stub
        self._tasks: dict[str, asyncio.Task] = {}  # request -> the task serving its stream
        # request -> (its decode worker, the id that worker knows it by), while the call is open
        self.decoding: dict[str, tuple[WorkerRecord, str]] = {}
        self.prefilling: set[str] = set()  # requests with a Decode open, their prefill still running
        self._aborted: weakref.WeakSet[asyncio.Task] = weakref.WeakSet()  # cancelled by ``abort``

    def track(self, request_id: str) -> asyncio.Task | None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks[request_id] = task
        return task

    def untrack(self, request_id: str, task: asyncio.Task | None) -> None:
        if self._tasks.get(request_id) is task:
            del self._tasks[request_id]

    def take_aborted(self) -> bool:
        """Whether ``abort`` (not the caller) cancelled the current task's stream; asked once, by the
        stream's handler."""
        task = asyncio.current_task()
        if task is not None and task in self._aborted:
            self._aborted.discard(task)
            return True
        return False

    async def abort(self, request_id: str, decode_workers: list[WorkerRecord]) -> bool:
        entry = self.decoding.get(request_id)
        if (
            entry is not None
            and request_id not in self.prefilling
            and await self._ask(entry[0], entry[1], log=True)
        ):
            return True
        task = self._tasks.get(request_id)
        if task is not None and task is not asyncio.current_task():
            self._aborted.add(task)
            task.cancel()
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
