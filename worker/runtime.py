"""The runtime both worker roles extend: one engine, its KV transfer agent, a gRPC server, and
membership in the registry.

A worker's life: constructed (model loaded, KV pool allocated, transfer agent registered over it)
-> ``serve(host, port)``: the engine loop starts, the gRPC server binds and starts, the role's
``before_register`` warm-up runs (decode: NIXL connections to the prefill workers), and only then
the worker registers in Redis, so the router sends nothing here before it is ready -> serving ->
``drain()``: it leaves the registry (no new routes) and waits until no work is left -> ``stop()``:
the engine loop, the registry link and the transfer agent close. If the engine loop *fails* (its step
raised), its streams have already failed; the worker leaves the registry at once (no new routes) and
its health check fails (``loop.alive`` is False) so the deployment replaces it.

Roles implement ``busy`` (work that must finish before a drain ends) and may override
``before_register`` and ``transfer_stats``; each role's ``service.serve`` passes its gRPC servicer.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import grpc
import redis

from engine.cpu_threads import build_off_thread
from engine.engine_core import EngineCore, EngineStats
from engine.engine_loop import EngineLoop
from engine.limits import RequestLimits
from kv_transfer import KVCompat, KVTransferBackend, RemoteKVInfo
from kv_transfer.stats import TransferStats
from proto import pdserve_pb2 as pb
from proto.socket_stream import CallStreamServer
from proto.stream_limits import grpc_options
from registry.publisher import RegistryPublisher
from worker.adapters import AdapterMixin
from worker.config import WorkerConfig
from worker.engine_client import EngineProcess
from worker.engine_registry import EngineRegistryLink
from worker.registry_link import IncompatibleKVLayoutError, RegistryLink, check_joins, worker_record
from worker.request_clock import RequestClocks
from worker.state import worker_state_to_proto

logger = logging.getLogger(__name__)


class RequestFailed(RuntimeError):
    """The engine ended this request with an error of the request's own (a grammar that allows none
    of the model's tokens, ...): not the worker's failure, so never retried on another worker and
    never counted against this one; its caller gets the reason (gRPC FAILED_PRECONDITION, or a
    ``request_failed`` stream error)."""


# (engine core, agent name, compatibility fingerprint) -> the transfer backend over the core's KV
TransferFactory = Callable[[EngineCore, str, KVCompat], KVTransferBackend]


def nixl_transfer(core: EngineCore, agent_name: str, compat: KVCompat) -> KVTransferBackend:
    """A NIXL agent registered over the engine's KV tensor. It runs without NIXL's progress thread
    (it spins a whole core): the engine loop ticks every few ms and drives progress, and our own
    thread while its reads are in flight (a prefill worker's also while it holds prompts)."""
    from kv_transfer.nixl_backend import NixlBackend

    backend = NixlBackend(agent_name, core.runner.kv_blocks, compat, progress_thread=False)
    backend.keep_progressing()
    return backend


class WorkerRuntime(AdapterMixin, ABC):
    role: ClassVar[str]

    def __init__(self, config: WorkerConfig, transfer_factory: TransferFactory | None = None) -> None:
        self.config = config
        self.worker_id = config.worker_id
        self.epoch = time.time_ns()
        self.engine: EngineProcess | None = None
        self.core: EngineCore | None = None
        self.transfer: KVTransferBackend | None = None
        if config.engine_process:  # the engine in a process of its own (a role's, with its args)
            module, role_args = self.engine_module()
            self.engine = EngineProcess(
                config.engine, model_name=config.served_model, module=module, role_args=role_args
            )
            self.compat = self.engine.facts.compat
            self.loop: EngineLoop | EngineProcess = self.engine
        else:
            # Built on a passing thread: the engine loop's thread is then torch's only CPU-pool master
            # (``engine.cpu_threads``; with 2+ torch threads a second master makes every op slower).
            self.core = build_off_thread(lambda: EngineCore(config.engine))
            self.compat = KVCompat.from_layout(config.served_model, self.core.layout)
            # Named after the worker and its epoch, so a restarted worker is a new peer.
            self.transfer = (transfer_factory or nixl_transfer)(
                self.core, f"{self.worker_id}-{self.epoch}", self.compat
            )
            self.loop = EngineLoop(self.core)
        # The LoRA adapters it serves (name -> prefix salt suffix), as its registry record lists them.
        self.loras = self.engine.facts.loras if self.engine is not None else self.core.lora_salts()
        self.loop.on_failure(self._on_engine_failure)
        self.clocks = RequestClocks(self.loop)  # per-request hop timing
        self.registry: RegistryLink | EngineRegistryLink | None = None
        self.draining = False
        self.address = ""
        self.server: grpc.aio.Server | None = None
        self.calls: CallStreamServer | None = None  # the call stream over a socket, once serving
        self.streams_address = ""  # its host:port (registered; empty: gRPC streams only)

    # Role hooks -------------------------------------------------------------------------------

    @abstractmethod
    async def busy(self) -> int:
        """How many requests (running, queued, held, in transfer) a drain must wait for."""

    async def before_register(self) -> None:
        """Warm-up after the server started and before the worker is routable (none by default)."""
        return None

    def transfer_stats(self) -> TransferStats | None:
        """Engine thread only: this role's KV-pull statistics, if it pulls."""
        return None

    def engine_module(self) -> tuple[str, tuple[str, ...]]:
        """The engine process's entry point and its role's arguments (the plain engine by default)."""
        return "worker.engine_process", ()

    @property
    def limits(self) -> RequestLimits:
        return self.engine.facts.limits if self.engine is not None else self.core.limits

    @property
    def prefix_salt(self) -> str:
        return self.engine.facts.prefix_salt if self.engine is not None else self.core.prefix_salt

    def record(self, address: str):
        return worker_record(
            self.worker_id,
            self.role,
            address,
            self.epoch,
            self.compat,
            self.limits,
            self.prefix_salt,
            kv_handoff=self.transfer_info() is not None,  # an agent over its KV: it takes hand-offs
            loras=self.loras,
            streams=self.streams_address,
            prefix_caching=self.config.engine.enable_prefix_caching,
        )

    # Lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        self.loop.start()

    async def serve(
        self,
        add_service: Callable[[grpc.aio.Server], None],
        host: str = "127.0.0.1",
        port: int = 0,
        calls: CallStreamServer | None = None,
    ) -> tuple[grpc.aio.Server, str]:
        """Bind ``host:port`` (0 picks a port), add the role's servicer (``self.address`` is known by
        then), start the engine loop and the server, and ``calls`` (the role's call stream over a
        socket, on the same host: ``proto.socket_stream``) unless ``socket_streams`` is off; warm up,
        then register; returns (server, "host:port")."""
        server = grpc.aio.server(options=grpc_options())  # it carries the role's call stream
        bound = server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"cannot bind {host}:{port}")
        self.address = f"{host}:{bound}"
        self.server = server
        add_service(server)
        self.start()
        await server.start()
        if calls is not None and self.config.socket_streams:
            try:
                self.streams_address = await calls.start(host)
            except OSError:
                await server.stop(0)
                self.stop()
                raise
            self.calls = calls
        try:
            await self.check_joins()
        except IncompatibleKVLayoutError:
            await server.stop(0)
            if self.calls is not None:
                await self.calls.stop()
            self.stop()
            raise
        await self.before_register()
        await self.load_cluster_adapters()
        self.attach_registry(self.address)
        logger.info("%s worker %s (epoch %d) on %s", self.role, self.worker_id, self.epoch, self.address)
        return server, self.address

    async def check_joins(self) -> None:
        """Raise ``IncompatibleKVLayoutError`` when the registry lists workers of this model whose KV
        layout differs from ours (a Redis that cannot be read is left to the registry link)."""
        if not self.config.redis_url:
            return
        record = self.record(self.address)
        try:
            await asyncio.to_thread(check_joins, self.config.redis_url, record)
        except (OSError, redis.RedisError) as exc:
            logger.warning("could not check the registered workers' KV layouts: %s", exc)

    def attach_registry(self, address: str) -> None:
        """Register in Redis under ``address`` and publish this worker's KV events (from the loop)."""
        if not self.config.redis_url:
            return
        record = self.record(address)
        publisher = RegistryPublisher(self.config.redis_url, record)
        publisher.start()
        if self.engine is not None:  # the engine process sends its cache's events with its outputs
            self.registry = EngineRegistryLink(self.engine, publisher)
            return
        self.registry = RegistryLink(self.core, publisher, lambda: self.loop.recent_step_s)
        self.loop.add_tick(self.registry.tick)

    def _on_engine_failure(self, failure: Exception) -> None:
        """Engine thread, dying: leave the registry (its Redis calls in a thread of their own)."""
        registry, self.registry = self.registry, None
        logger.error("%s %s is unhealthy: %s; leaving the registry", self.role, self.worker_id, failure)
        if registry is not None:
            threading.Thread(target=registry.stop, name="registry-leave", daemon=True).start()

    async def drain(self, timeout_s: float = 30.0, quiet_s: float = 1.0) -> bool:
        """Leave the registry so no new request is routed here, then wait until ``busy()`` stays 0.

        Requests already routed (the router's view lags by an event) are still served; ``quiet_s``
        of continuous idleness covers a request between its prefill and its decode call. Returns
        False if work remained after ``timeout_s``.
        """
        self.draining = True
        await self.leave_registry()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        idle_since = None
        while True:
            if self.loop.failure is not None:  # its streams already failed; nothing will finish
                return False
            left = await self.busy()
            now = loop.time()
            if left == 0:
                idle_since = idle_since if idle_since is not None else now
                if now - idle_since >= quiet_s:
                    return True
            else:
                idle_since = None
            if now >= deadline:
                logger.warning(
                    "%s %s: %d requests still running after %.0fs of draining",
                    self.role,
                    self.worker_id,
                    left,
                    timeout_s,
                )
                return left == 0
            await asyncio.sleep(0.05)

    async def leave_registry(self) -> None:
        """Deregister (idempotent): the routers route nothing new here from their next poll."""
        if self.registry is not None:
            registry, self.registry = self.registry, None
            await asyncio.to_thread(registry.stop)

    def stop(self) -> None:
        self.loop.stop()
        if self.registry is not None:
            self.registry.stop()
            self.registry = None
        if self.transfer is not None:
            self.transfer.close()
        if self.core is not None:
            self.core.close()  # the disk tier's file (the engine thread has stopped)

    async def shutdown(self, grace_s: float = 1.0) -> None:
        """Leave the registry, stop the gRPC server (``grace_s`` for calls in flight), then the
        worker. (It left only in ``stop``, after the grace: for those seconds the routers still sent
        it requests, which bounced, and each marked it suspect and counted a migration.)"""
        await self.leave_registry()
        if self.calls is not None:  # its calls' grace runs beside the gRPC server's
            await asyncio.gather(self.calls.stop(grace_s), self.server.stop(grace=grace_s))
        elif self.server is not None:
            await self.server.stop(grace=grace_s)
        await asyncio.to_thread(self.stop)

    # State ------------------------------------------------------------------------------------

    def transfer_info(self) -> RemoteKVInfo | None:
        """How a peer reads this worker's KV (None: it takes part in no hand-off)."""
        if self.engine is not None:
            return self.engine.facts.transfer
        return self.transfer.local_info() if self.transfer is not None else None

    async def stats(self) -> EngineStats:
        if self.engine is not None:
            return await self.engine.stats()
        return await self.loop.run(self.core.stats)

    async def get_state(self) -> pb.WorkerState:
        """The GetState answer: identity, transfer metadata, engine and transfer statistics."""

        if self.engine is not None:
            t = self.transfer_stats()
            stats = await self.engine.stats()
            return worker_state_to_proto(self, self.address, stats, t.snapshot() if t is not None else None)

        def snapshot() -> tuple[EngineStats, TransferStats | None]:
            t = self.transfer_stats()
            return self.core.stats(), (t.snapshot() if t is not None else None)

        stats, transfer = await self.loop.run(snapshot)
        return worker_state_to_proto(self, self.address, stats, transfer)
