"""What every worker process shares: common flags, UCX device choice, and serving until a signal.

Used by ``python -m prefill_worker`` and ``python -m decode_worker``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_worker_args(parser: argparse.ArgumentParser, role: str) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--worker-id", default=f"{role}-0")
    parser.add_argument(
        "--ucx-net-devices",
        default=None,
        help="network devices NIXL/UCX may use (UCX_NET_DEVICES); default: lo when bound to loopback",
    )
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("PDSERVE_REDIS_URL"),
        help="registry and KV-event Redis (redis:// or rediss://, AUTH in the URL); env PDSERVE_REDIS_URL",
    )
    parser.add_argument("--log-level", default="WARNING")


def prepare_process(args: argparse.Namespace) -> None:
    """Logging, and UCX's devices (before NIXL initialises UCX): loopback-bound workers stay local."""
    devices = args.ucx_net_devices or ("lo" if args.host in LOOPBACK else None)
    if devices:
        os.environ["UCX_NET_DEVICES"] = devices
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


async def start_server(
    worker: Any,
    host: str,
    port: int,
    add_service: Callable[[grpc.aio.Server, str], None],
    before_register: Callable[[], Awaitable[None]] | None = None,
) -> tuple[grpc.aio.Server, str]:
    """Bind ``host:port`` (0 picks a port), add the worker's service, start its engine loop and the
    server, run ``before_register`` (warm-up), then register; returns (server, "host:port").

    Registering last means the router sends nothing here before the worker is ready for it."""
    server = grpc.aio.server()
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    address = f"{host}:{bound}"
    add_service(server, address)
    worker.start()
    await server.start()
    if before_register is not None:
        await before_register()
    worker.attach_registry(address)
    logging.getLogger(__name__).info(
        "%s worker %s (epoch %d) on %s", worker.role, worker.worker_id, worker.epoch, address
    )
    return server, address


async def serve_until_signal(
    worker: Any, serve: Callable[[Any, str, int], Awaitable[tuple[Any, str]]], host: str, port: int
) -> None:
    """Serve, print ``LISTENING host:port`` (for supervisors and tests), stop on SIGINT/SIGTERM."""
    server, address = await serve(worker, host, port)
    print(f"LISTENING {address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=2)
    worker.stop()


async def drain_worker(
    worker: Any, busy: Callable[[], Awaitable[int]], timeout_s: float, quiet_s: float = 1.0
) -> bool:
    """Leave the registry so no new request is routed here, then wait until ``busy()`` stays 0.

    Requests already routed (the router's view lags by an event) are still served; ``quiet_s`` of
    continuous idleness covers a request between its prefill and its decode call. Returns False if
    work remained after ``timeout_s``.
    """
    worker.draining = True
    if worker.registry is not None:
        registry, worker.registry = worker.registry, None
        await asyncio.to_thread(registry.stop)  # deregisters
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    idle_since = None
    while True:
        left = await busy()
        now = loop.time()
        if left == 0:
            idle_since = idle_since if idle_since is not None else now
            if now - idle_since >= quiet_s:
                return True
        else:
            idle_since = None
        if now >= deadline:
            logging.getLogger(__name__).warning(
                "%s %s: %d requests still running after %.0fs of draining",
                worker.role,
                worker.worker_id,
                left,
                timeout_s,
            )
            return left == 0
        await asyncio.sleep(0.05)
