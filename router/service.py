"""gRPC face of the router (asyncio): Generate (server stream), Abort, GetClusterState."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from proto.call_stream import MultiplexedGenerate
from proto.convert import params_from_proto
from proto.socket_stream import CallStreamServer
from proto.stream_limits import grpc_options
from registry.cluster_view import ClusterView
from router.adapters import AdapterChangeFailed, change_adapter
from router.migration import MigrationRefused
from router.policies import AdapterNotServed
from router.router import NoWorkersError, Router

logger = logging.getLogger(__name__)


class RouteFailed(Exception):
    """A request the router could not serve, as the status its caller gets."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


# A worker call's failures whose details are the transport's (connections, addresses), not the
# worker's words about the request (INVALID_ARGUMENT, NOT_FOUND... are passed on as they are).
TRANSPORT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)


async def caller_stream(
    router: Router, request_id: str, prompt: list[int], params, priority: int, deadline: float | None
) -> AsyncIterator[pb.GenerateResponse]:
    """``Router.generate`` as its caller sees it, over gRPC or in the same process: an abort by
    ``Router.Abort`` ends the stream with an ``abort`` finish; every failure is a ``RouteFailed``."""
    try:
        stream = router.generate(request_id, prompt, params, priority=priority, deadline=deadline)
        async with aclosing(stream):  # a caller that leaves closes it now, not when it is collected
            async for msg in stream:
                yield msg
    except NoWorkersError as exc:
        code = grpc.StatusCode.NOT_FOUND if isinstance(exc, AdapterNotServed) else grpc.StatusCode.UNAVAILABLE
        router.stats.fail(code)
        raise RouteFailed(code, str(exc)) from None
    except MigrationRefused as exc:  # its decode worker was lost and it cannot move (a 503)
        router.stats.fail(exc.code)
        raise RouteFailed(exc.code, str(exc)) from None
    except grpc.aio.AioRpcError as exc:  # a worker's refusal (passed on as is) or failure
        router.stats.fail(exc.code())
        details = exc.details() or str(exc.code())
        if exc.code() in TRANSPORT_CODES:  # the details name addresses (gRPC's, the socket stream's)
            logger.warning("%s failed: %s", request_id, details)
            details = f"a worker could not serve the request ({exc.code().name.lower().replace('_', ' ')})"
        raise RouteFailed(exc.code(), details) from None


def check_context(prompt_len: int, max_tokens: int | None, view: ClusterView) -> None:
    """Refuse (``ValueError``) a request no decode worker could hold, before it is hashed or routed:
    the router's gRPC API is public, and a prompt of a million tokens would cost its event loop
    seconds before a worker refused it. The bound is the largest context (``max_model_len``) of the
    live decode workers (every request ends on one); none while one does not publish it (0: a worker
    of an older version; the workers check then). ``max_tokens`` unset: at least one token."""
    limits = [w.max_model_len for w in view.live_workers("decode")]
    if not limits or 0 in limits:
        return
    limit = max(limits)
    if max_tokens is None:
        if prompt_len >= limit:
            raise ValueError(
                f"prompt ({prompt_len} tokens) leaves no room to generate within the model's context "
                f"length of {limit} tokens"
            )
    elif prompt_len + max_tokens > limit:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {prompt_len + max_tokens} exceeds "
            f"the model's context length of {limit} tokens"
        )


class RouterService(MultiplexedGenerate, pb_grpc.RouterServicer):
    def __init__(self, router: Router) -> None:
        self.router = router
        self.call_streams = ""  # host:port of the Generate call stream on a socket, once served

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            if not request.request_id:
                raise ValueError("request_id is required")
            if not request.prompt_token_ids:
                raise ValueError("prompt must contain at least one token")
            params = params_from_proto(request.params)
            check_context(len(request.prompt_token_ids), params.max_tokens, self.router.view)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        prompt = list(request.prompt_token_ids)
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        try:
            stream = caller_stream(
                self.router, request.request_id, prompt, params, request.priority, deadline
            )
            async with aclosing(stream):
                async for msg in stream:
                    yield msg
        except RouteFailed as exc:
            await context.abort(exc.code, exc.details)

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        return pb.AbortResponse(aborted=await self.router.abort(request.request_id))

    async def Adapter(self, request: pb.AdapterRequest, context) -> pb.AdapterResponse:
        try:
            workers = await change_adapter(self.router, request)
        except AdapterChangeFailed as exc:
            await context.abort(exc.code, exc.details)
        return pb.AdapterResponse(workers=workers)

    async def GetClusterState(self, request, context) -> pb.ClusterState:
        r, view = self.router, self.router.view
        workers = []
        for w in view.live_workers():
            load = r.inflight.get(w.worker_id)
            workers.append(
                pb.WorkerSummary(
                    state=pb.WorkerState(
                        worker_id=w.worker_id,
                        epoch=w.epoch,
                        role=w.role,
                        address=w.address,
                        model=w.model,
                        stats=pb.EngineStats(
                            num_running=w.num_running,
                            num_waiting=w.num_waiting,
                            num_blocks=w.num_blocks,
                            num_free_blocks=w.num_free_blocks,
                            kv_usage=1 - w.num_free_blocks / w.num_blocks if w.num_blocks else 0.0,
                        ),
                    ),
                    healthy=w.worker_id not in r.suspects,
                    queued_prompt_tokens=max(w.queued_prompt_tokens, load.prompt_tokens if load else 0),
                )
            )
        s = r.stats
        return pb.ClusterState(
            workers=workers,
            degraded=view.degraded,
            policy=r.policy.name,
            router_id=s.router_id,
            requests_routed=s.requests,
            prompt_tokens=s.prompt_tokens,
            predicted_hit_tokens=s.predicted_hit_tokens,
            delivered_hit_tokens=s.delivered_hit_tokens,
            predicted_prefix_hit_rate=s.predicted_hit_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
            delivered_prefix_hit_rate=s.delivered_hit_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
            index_entries=view.index.size,
            event_lag_seconds=view.event_lag_s,
            events_applied=view.events_applied,
            gaps_detected=view.index.gaps_detected,
            resyncs=view.resyncs,
            decisions=[
                pb.RoutingCount(role=role, worker_id=w, requests=n) for (role, w), n in r.decisions.items()
            ],
            prefill_retries=s.prefill_retries,
            aggregated_fallbacks=s.aggregated_fallbacks,
            failed_requests=s.failed,
            failed_by_code=s.failed_by_code,
            active_requests=r.active,
            decode_retries=s.decode_retries,
            local_prefills=s.local_prefills,
            kv_streamed=s.kv_streamed,
            peer_reads=s.peer_reads,
            draining=view.draining,
            hop_timing=r.hops.summary(),
            migrations=s.migrations,
            stalls=s.stalls,
            migrations_refused=s.migrations_refused,
            suspect_workers=sorted(r.suspects),
            indexed=_indexed(view.index),
            adapters=sorted({name for w in view.live_workers("decode") for name in w.adapters()}),
            call_streams=self.call_streams,
        )


def _indexed(index) -> list[pb.IndexedWorker]:
    with index.lock:
        return [
            pb.IndexedWorker(
                worker_id=w,
                epoch=index.epoch_of(w) or 0,
                blocks=index.num_blocks_of(w),
                host_blocks=index.num_host_blocks_of(w),
                disk_blocks=index.num_disk_blocks_of(w),
            )
            for w in sorted(index.workers())
        ]


class RouterServers:
    """The router's gRPC server and, with ``socket_streams``, its Generate call stream on a socket
    (``proto.socket_stream``; its address in ``GetClusterState.call_streams``, where a front end's
    ``RouterClient`` finds it): ``stop`` stops both."""

    def __init__(self, grpc_server: grpc.aio.Server, calls: CallStreamServer | None) -> None:
        self.grpc_server, self.calls = grpc_server, calls

    async def stop(self, grace: float | None = None) -> None:
        if self.calls is None:
            await self.grpc_server.stop(grace)
            return
        await asyncio.gather(self.grpc_server.stop(grace), self.calls.stop(grace or 0.0))


async def serve(
    router: Router, host: str = "127.0.0.1", port: int = 0, socket_streams: bool = True
) -> tuple[RouterServers, str]:
    server = grpc.aio.server(options=grpc_options())  # it carries GenerateStream
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    service = RouterService(router)
    pb_grpc.add_RouterServicer_to_server(service, server)
    await server.start()
    calls = None
    if socket_streams:
        calls = CallStreamServer(service.Generate, "generate")
        service.call_streams = await calls.start(host)
    address = f"{host}:{bound}"
    logger.info(
        "router (%s) on %s (call streams: %s)", router.policy.name, address, service.call_streams or "gRPC"
    )
    return RouterServers(server, calls), address
