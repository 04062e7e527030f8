"""gRPC face of the decode worker (asyncio): Decode (server stream), DecodeStream (many Decode calls
multiplexed on one stream, what the router uses), ProvideKV, Abort, GetState, Lend (a peer decode
worker reads prefix blocks from this one's host tier: ``worker.peer_reads``).

Bad requests are refused with INVALID_ARGUMENT before the engine is touched, and every request with
UNAVAILABLE once the engine loop failed; failures after the stream started arrive in-band as a
``StreamError`` message, then the stream ends (``unavailable``: the worker cannot go on, the router
resumes the request elsewhere). A quiet stream carries ``Progress`` messages. A cancelled call
(client gone, deadline passed) aborts the request and frees its blocks.
"""

from __future__ import annotations

import logging

import grpc

from decode_worker.kv_pull import KVTransferError, pulled_kv_from_handle
from decode_worker.worker import DecodeWorker, Progress, WorkerUnavailableError
from engine.engine_loop import EngineLoopFailed
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from proto.call_stream import MultiplexedDecode
from proto.convert import params_from_proto, stop_reason_fields, tokens_message
from proto.socket_stream import CallStreamServer
from worker.adapters import adapter_rpc
from worker.peer_reads import lend_rpc
from worker.runtime import RequestFailed

logger = logging.getLogger(__name__)


class DecodeService(MultiplexedDecode, pb_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        prompt = list(request.prompt_token_ids)
        try:
            if not rid:
                raise ValueError("request_id is required")
            params = params_from_proto(request.params)
            kv = pulled_kv_from_handle(request.handle) if request.HasField("handle") else None
            if kv is not None and request.kv_source:
                raise ValueError("a Decode takes either a KV handle or a kv_source, not both")
            peer = request.peer if request.HasField("peer") else None
            if peer is not None and (kv is not None or request.kv_source):
                raise ValueError(
                    "a Decode with a peer to read the prefix from takes no KV handle or kv_source"
                )
            if peer is not None and not peer.address:
                raise ValueError("peer.address is required")
            if kv is not None and kv.num_tokens != len(prompt):
                raise ValueError(f"KV handle covers {kv.num_tokens} tokens but the prompt has {len(prompt)}")
            await self.worker.check_request(prompt, params, handoff=kv is not None or bool(request.kv_source))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if self.worker.loop.failure is not None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"{self.worker.worker_id}: {self.worker.loop.failure}"
            )
        completion = 1 if kv is not None or request.kv_source else 0
        keepalive = self.worker.config.keepalive_s or None
        sent_hits = False  # the prompt's cache hit rides on the first chunk (``TokenChunk.cached_tokens``)
        try:
            async for out in self.worker.decode(
                rid,
                prompt,
                params,
                priority=request.priority,
                kv=kv,
                keepalive_s=keepalive,
                kv_source=request.kv_source or None,
                peer=peer,
            ):
                if isinstance(out, Progress):
                    yield pb.GenerateResponse(
                        progress=pb.Progress(
                            step_ms=out.step_s * 1e3,
                            blocked_ms=out.blocked_s * 1e3,
                            interval_ms=out.interval_s * 1e3,
                        )
                    )
                    continue
                if out.new_token_ids:
                    completion += len(out.new_token_ids)
                    yield tokens_message(
                        out.sample_index,
                        out.new_token_ids,
                        out.new_logprobs,
                        out.prompt_logprobs,
                        cached_tokens=None if sent_hits else out.num_cached_tokens,
                    )
                    sent_hits = True
                if out.finish_reason is not None:
                    yield pb.GenerateResponse(
                        finished=pb.Finished(
                            sample_index=out.sample_index,
                            finish_reason=out.finish_reason,
                            **stop_reason_fields(out.stop_reason),
                            usage=pb.Usage(
                                prompt_tokens=len(prompt),
                                completion_tokens=completion,
                                cached_tokens=out.num_cached_tokens,
                            ),
                            timing=self._timing(rid),
                        )
                    )
        except ValueError as exc:
            yield pb.GenerateResponse(error=pb.StreamError(code="invalid_argument", message=str(exc)))
        except KVTransferError as exc:
            yield pb.GenerateResponse(error=pb.StreamError(code="kv_transfer_failed", message=str(exc)))
        except (WorkerUnavailableError, EngineLoopFailed) as exc:
            logger.warning("decode of %s cannot go on here: %s", rid, exc)
            yield pb.GenerateResponse(error=pb.StreamError(code="unavailable", message=str(exc)))
        except RequestFailed as exc:  # the request's own fault (not retried, not the worker's failure)
            yield pb.GenerateResponse(error=pb.StreamError(code="request_failed", message=str(exc)))
        except RuntimeError as exc:
            logger.warning("decode of %s failed: %s", rid, exc)
            yield pb.GenerateResponse(error=pb.StreamError(code="internal", message=str(exc)))

    def _timing(self, rid: str) -> pb.HopTiming:
        """This worker's part of the request's hop timing (empty for a request that never produced
        a token here)."""
        clock = self.worker.clocks.get(rid)
        if clock is None or clock.first_output is None:
            return pb.HopTiming()
        t = pb.HopTiming(decode_queue_ms=clock.queue_s * 1e3, decode_first_step_ms=clock.first_step_s * 1e3)
        if clock.kv_transfer_s is not None:
            t.kv_transfer_ms = clock.kv_transfer_s * 1e3
        return t

    async def ProvideKV(self, request: pb.ProvideKVRequest, context) -> pb.ProvideKVResponse:
        accepted = self.worker.provide_kv(request.request_id, pulled_kv_from_handle(request.handle))
        return pb.ProvideKVResponse(accepted=accepted)

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        return pb.AbortResponse(aborted=await self.worker.abort(request.request_id))

    async def Lend(self, request: pb.LendRequest, context) -> pb.LendResponse:
        """Pin the prompt's leading blocks held here for a peer decode worker's read."""
        return await lend_rpc(self.worker, request, context)

    async def Adapter(self, request: pb.AdapterRequest, context) -> pb.AdapterResponse:
        return await adapter_rpc(self.worker, request, context)

    async def GetState(self, request, context) -> pb.WorkerState:
        if self.worker.loop.failure is not None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"{self.worker.worker_id}: {self.worker.loop.failure}"
            )
        return await self.worker.get_state()


async def serve(worker: DecodeWorker, host: str = "127.0.0.1", port: int = 0) -> tuple[grpc.aio.Server, str]:
    """Start the worker's engine loop and gRPC server, warm its NIXL peers, then register it;
    returns (server, "host:port")."""
    service = DecodeService(worker)
    return await worker.serve(
        lambda server: pb_grpc.add_DecodeWorkerServicer_to_server(service, server),
        host,
        port,
        CallStreamServer(service.Decode, "decode"),
    )
