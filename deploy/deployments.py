"""Ray Serve deployments: thin wrappers that construct the plain worker, router and ingress objects.

Each replica's life: constructed by Serve (model loaded, gRPC server bound, registered in Redis) ->
serving, with ``check_health`` failing when its engine loop is stuck or dead, not only when the
process is gone -> stopped by Serve (scale-down, redeploy, shutdown): ``__del__`` drains first —
a worker leaves the registry so nothing new is routed to it, then waits for its running requests;
the router waits for its open streams — and only then closes. Everything between replicas travels
over gRPC (protobuf) and NIXL; Serve handles carry only the router's address string.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ray import serve

from deploy.config import PDServeConfig
from deploy.pool_autoscaling import ENGINE_REQUESTS
from deploy.replica_grpc import keep_replica_grpc_on_loopback
from settings import environment, gc_policy

logger = logging.getLogger(__name__)
keep_replica_grpc_on_loopback()  # in each replica's process, before Serve starts its gRPC server


def _bind_host(config: PDServeConfig) -> str:
    if config.worker_host == "auto":
        import ray

        return ray.util.get_node_ip_address()
    return config.worker_host


def _replica_id() -> str:
    return serve.get_replica_context().replica_id.unique_id


async def _ingress(config: PDServeConfig, client):
    """The OpenAI endpoint's object (``ingress.server.Ingress``) over ``client``'s router."""
    from ingress.model_info import load_model_info
    from ingress.server import Ingress, api_key_from

    info = await asyncio.to_thread(
        load_model_info, config.model, config.model_name, config.engine.max_model_len, config.tiny_model
    )
    return Ingress(
        info,
        config.ingress,
        client,
        api_key_from(config.ingress.api_key_file),
        expect_prefill=config.mode == "disaggregated",
        replica=_replica_id(),
    )


async def _serve_ingress(config: PDServeConfig, client):
    """An ingress over ``client`` serving HTTP from this replica on ``ingress.host:port``."""
    from ingress.server import serve_http

    ingress = await _ingress(config, client)
    return ingress, await serve_http(ingress.http, config.ingress.host, config.ingress.port)


class _WorkerReplica:
    """What the prefill and decode replicas share: health, state, draining shutdown."""

    worker = None
    config: PDServeConfig

    async def get_address(self) -> str:
        return self.worker.address

    async def check_health(self) -> None:
        loop = self.worker.loop
        if not loop.alive:
            raise RuntimeError(f"{self.worker.worker_id}: engine loop is not running")
        stuck = loop.stuck_for()
        if stuck > self.config.engine_stuck_timeout_s:
            raise RuntimeError(f"{self.worker.worker_id}: engine loop made no progress for {stuck:.0f}s")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's autoscaling hook: the pool scales on its engines' requests (deploy/pool_autoscaling.py)."""
        s = await self.worker.stats()
        return {ENGINE_REQUESTS: s.num_running + s.num_waiting + s.num_transferring}

    async def __del__(self) -> None:
        if self.worker is None:
            return
        timeout = self._options().graceful_shutdown_timeout_s
        drained = await self.worker.drain(max(0.0, timeout - 2.0))
        logger.info("%s drained (%s); stopping", self.worker.worker_id, "clean" if drained else "timed out")
        await self.worker.shutdown(grace_s=1.0)
        self.worker = None


@serve.deployment(name="Prefill")
class PrefillServer(_WorkerReplica):
    async def __init__(self, config: PDServeConfig) -> None:
        from prefill_worker.service import serve as serve_prefill
        from prefill_worker.split import build_prefill_worker
        from prefill_worker.worker import PrefillWorkerConfig

        self.config = config
        host = _bind_host(config)
        environment.use_ucx_devices(None, host, override=False)
        t0 = time.perf_counter()
        self.worker = build_prefill_worker(
            PrefillWorkerConfig(
                config.engine_for("prefill").engine_config(config.model),
                worker_id=f"prefill-{_replica_id()}",
                lease_seconds=config.prefill.lease_seconds,
                model_name=config.model_name,
                redis_url=environment.require_redis_url(config.redis_url),
                engine_process=config.engine_process("prefill"),
                socket_streams=config.prefill.socket_streams,
            )
        )
        await serve_prefill(self.worker, host, 0)
        gc_policy.settle_heap()
        logger.info(
            "%s ready on %s in %.1fs", self.worker.worker_id, self.worker.address, time.perf_counter() - t0
        )

    def _options(self):
        return self.config.prefill


@serve.deployment(name="Decode")
class DecodeServer(_WorkerReplica):
    async def __init__(self, config: PDServeConfig) -> None:
        from decode_worker.service import serve as serve_decode
        from decode_worker.split import build_decode_worker
        from decode_worker.worker import DecodeWorkerConfig

        self.config = config
        host = _bind_host(config)
        environment.use_ucx_devices(None, host, override=False)
        t0 = time.perf_counter()
        self.worker = build_decode_worker(
            DecodeWorkerConfig(
                config.engine_for("decode").engine_config(config.model),
                worker_id=f"decode-{_replica_id()}",
                kv_failure_policy=config.decode.kv_failure_policy,
                transfer_timeout_s=config.decode.transfer_timeout_s,
                keepalive_s=config.decode.keepalive_s,
                stream_interval=config.decode.stream_interval,
                model_name=config.model_name,
                redis_url=environment.require_redis_url(config.redis_url),
                engine_process=config.engine_process("decode"),
                socket_streams=config.decode.socket_streams,
            )
        )
        # Registers after connecting NIXL to every registered prefill worker, and keeps connecting to
        # new ones (the decode worker does it itself, as under ``python -m decode_worker``).
        await serve_decode(self.worker, host, 0)
        gc_policy.settle_heap()
        logger.info(
            "%s ready on %s in %.1fs", self.worker.worker_id, self.worker.address, time.perf_counter() - t0
        )

    def _options(self):
        return self.config.decode


@serve.deployment(name="Router")
class RouterServer:
    async def __init__(self, config: PDServeConfig, workers: list | None = None) -> None:
        from registry.cluster_view import ClusterView
        from router.local_client import LocalRouterClient
        from router.router import Router
        from router.service import serve as serve_router

        self.config = config
        self.view = ClusterView(environment.require_redis_url(config.redis_url))
        self.view.start()
        if not await asyncio.to_thread(self.view.wait_synced, 10.0):
            logger.warning("router started before the registry answered; routing once it does")
        r = config.router
        self.router = Router(
            self.view,
            r.policy,
            local_prefill_tokens=r.local_prefill_tokens,
            migration=r.migration(),
            kv_streaming_tokens=r.kv_streaming_tokens,
            peer_reads=r.peer_reads,
        )
        self.server, self.address = await serve_router(
            self.router, _bind_host(config), 0, socket_streams=r.socket_streams
        )
        # ``http_server: router``: this replica is also the HTTP endpoint, the ingress calling the
        # router in-process (no ingress replica, no gRPC hop between them).
        self.ingress, self._http = None, None
        if config.ingress.http_server == "router":
            self.ingress, self._http = await _serve_ingress(config, LocalRouterClient(self.router))
        gc_policy.settle_heap()

    async def get_address(self) -> str:
        return self.address

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's autoscaling hook: the requests streaming through this router (its callers, an
        ingress or its own HTTP, reach it outside Serve: deploy/pool_autoscaling.py)."""
        return {ENGINE_REQUESTS: self.router.active}

    async def check_health(self) -> None:
        if not self.view.alive:
            raise RuntimeError("the router's cluster view thread died")
        if self._http is not None and self._http.task.done():
            raise RuntimeError("the router's HTTP server stopped")

    async def __del__(self) -> None:
        if self.ingress is not None:
            await self.ingress.close()  # new requests get 503 while the rest drains
        deadline = time.monotonic() + max(0.0, self.config.router.graceful_shutdown_timeout_s - 2.0)
        while self.router.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._http is not None:
            await self._http.stop()
        await self.server.stop(grace=1.0)
        await self.router.close()
        await asyncio.to_thread(self.view.stop)


@serve.deployment(name="Autoscaler", num_replicas=1, ray_actor_options={"num_cpus": 0})
class AutoscalerServer:
    """Runs the P/D autoscaling policy against this application (one replica)."""

    async def __init__(self, config: PDServeConfig, router) -> None:
        from deploy.scaling import AutoscalerLoop
        from router.client import RouterClient

        self.client = RouterClient(lambda: router.get_address.remote())
        self.loop = AutoscalerLoop(config.app_name, config.autoscaling, self.client)
        self.task = asyncio.get_running_loop().create_task(self.loop.run())

    async def decisions(self) -> list[tuple[float, int, int]]:
        return list(self.loop.decisions)

    async def check_health(self) -> None:
        if self.task.done():
            raise RuntimeError(f"the autoscaler loop ended: {self.task.exception()!r}")

    async def __del__(self) -> None:
        self.task.cancel()
        await self.client.close()


@serve.deployment(name="Ingress")
@serve.ingress()
class IngressServer:
    """The OpenAI HTTP endpoint: an ``ingress.server.Ingress`` per replica, its ASGI app served (FastAPI behind the generation routes)."""

    async def __init__(self, config: PDServeConfig, router, companions: list | None = None) -> None:
        from router.client import RouterClient

        client = RouterClient(lambda: router.get_address.remote())
        self.ingress = await _ingress(config, client)
        self._direct = None
        if config.ingress.http_server == "direct":
            from ingress.server import serve_http

            self._direct = await serve_http(self.ingress.http, config.ingress.host, config.ingress.port)
        gc_policy.settle_heap()

    def __serve_build_asgi_app__(self):
        return self.ingress.http

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's autoscaling hook, read with ``http_server: direct`` (HTTP reaches the replica
        outside Serve's proxy): its requests admitted or queued."""
        adm = self.ingress.serving.admission
        return {ENGINE_REQUESTS: adm.running + adm.waiting}

    async def __del__(self) -> None:
        await self.ingress.close()  # new requests get 503 while the server stops
        if self._direct is not None:
            await self._direct.stop()
