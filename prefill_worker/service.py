"""gRPC face of the prefill worker (asyncio): Prefill (also on a call stream, ``PrefillStream``: the
router's), Release, WatchKV, GetState, Lend."""

from __future__ import annotations

import logging

import grpc

from prefill_worker.worker import PrefillWorker
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from proto.call_stream import MultiplexedPrefill
from proto.convert import logprobs_to_proto, params_from_proto, prompt_logprobs_to_proto, stop_reason_fields
from proto.socket_stream import CallStreamServer
from worker.adapters import adapter_rpc
from worker.peer_reads import lend_rpc
from worker.runtime import RequestFailed

logger = logging.getLogger(__name__)


class PrefillService(MultiplexedPrefill, pb_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    async def Prefill(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrefillResponse:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        try:
            params = params_from_proto(request.params)
            peer = request.peer if request.HasField("peer") else None
            if peer is not None and not peer.address:
                raise ValueError("peer.address is required")
            result = await self.worker.prefill(
                request.request_id, list(request.prompt_token_ids), params, request.priority, peer
            )
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RequestFailed as exc:  # the request's own fault: the router does not retry it elsewhere
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except RuntimeError as exc:
            logger.warning("prefill of %s failed: %s", request.request_id, exc)
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        handle = self._handle(result.request_id)
        handle.block_ids.extend(result.block_ids)
        handle.num_tokens = result.num_tokens
        handle.lease_expiry_unix = result.lease_expiry_unix
        handle.first_token = result.first_token
        handle.first_logprobs.CopyFrom(logprobs_to_proto(result.first_logprobs))
        handle.seed = result.seed
        handle.num_cached_tokens = result.num_cached_tokens
        timing = pb.HopTiming(
            prefill_queue_ms=result.queue_s * 1e3, prefill_compute_ms=result.compute_s * 1e3
        )
        resp = pb.PrefillResponse(
            handle=handle, timing=timing, prompt_logprobs=prompt_logprobs_to_proto(result.prompt_logprobs)
        )
        if result.finish_reason is not None:
            resp.finished.CopyFrom(
                pb.Finished(
                    finish_reason=result.finish_reason,
                    **stop_reason_fields(result.stop_reason),
                    usage=pb.Usage(
                        prompt_tokens=result.num_tokens,
                        completion_tokens=1,
                        cached_tokens=result.num_cached_tokens,
                    ),  # the timing rides in the response once: the router merges it here
                )
            )
        return resp

    def _handle(self, request_id: str) -> pb.KVHandle:
        """Where this worker's KV of ``request_id`` lives: the request's blocks and token left out."""
        w = self.worker
        return pb.KVHandle(
            request_id=request_id,
            worker_id=w.worker_id,
            epoch=w.epoch,
            agent_name=w.transfer_info().agent_name,
            compat_hash=w.compat.hash(),
            address=w.address,
        )

    async def WatchKV(self, request: pb.WatchKVRequest, context):
        """The request's handle so far, once per step that finished blocks of its prompt."""
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        handle = self._handle(request.request_id)
        async for ids, complete in self.worker.watch_kv(request.request_id):
            handle.block_ids.extend(ids)
            yield pb.KVProgress(handle=handle, complete=complete)

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        if request.epoch and request.epoch != self.worker.epoch:
            return pb.ReleaseResponse(released=False)  # a previous incarnation's blocks are long gone
        return pb.ReleaseResponse(released=await self.worker.release(request.request_id))

    async def Lend(self, request: pb.LendRequest, context) -> pb.LendResponse:
        """Pin the prompt's leading blocks held here for the caller's read (none: an empty answer)."""
        return await lend_rpc(self.worker, request, context)

    async def Adapter(self, request: pb.AdapterRequest, context) -> pb.AdapterResponse:
        return await adapter_rpc(self.worker, request, context)

    async def GetState(self, request, context) -> pb.WorkerState:
        if self.worker.loop.failure is not None:  # its engine loop failed: it serves nothing more
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"{self.worker.worker_id}: {self.worker.loop.failure}"
            )
        return await self.worker.get_state()


async def serve(worker: PrefillWorker, host: str = "127.0.0.1", port: int = 0) -> tuple[grpc.aio.Server, str]:
    """Start the worker's engine loop, gRPC server and registry link; returns (server, "host:port")."""
    service = PrefillService(worker)
    return await worker.serve(
        lambda server: pb_grpc.add_PrefillWorkerServicer_to_server(service, server),
        host,
        port,
        CallStreamServer(service.prefill_call, "prefill", out="prefill"),
    )
