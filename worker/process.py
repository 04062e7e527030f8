"""What every worker process shares: common flags, UCX device choice, the KV transfer backend, and
serving until a signal.

Used by ``python -m prefill_worker`` and ``python -m decode_worker``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable

from kv_transfer import InProcessFabric
from settings import environment, gc_policy
from worker.registry_link import IncompatibleKVLayoutError
from worker.runtime import TransferFactory, WorkerRuntime, nixl_transfer

KV_TRANSFERS = ("nixl", "inprocess")


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
        default=environment.redis_url(),
        help="registry and KV-event Redis (redis:// or rediss://, AUTH in the URL); env PDSERVE_REDIS_URL",
    )
    parser.add_argument(
        "--kv-transfer",
        default="nixl",
        choices=KV_TRANSFERS,
        help="KV transfer backend: nixl (between processes and hosts), or inprocess (no NIXL imported; KV "
        "moves only between engines of one process, so a lone worker never hands KV to another: for "
        "aggregated serving on hosts without NIXL)",
    )
    parser.add_argument(
        "--socket-streams",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also serve the router's call stream on a plain socket beside gRPC (framed protobuf, "
        "same host; the router prefers it: a gRPC streamed message costs ~5x the CPU)",
    )
    parser.add_argument("--log-level", default="WARNING")


def transfer_factory_from_args(args: argparse.Namespace) -> TransferFactory:
    """The backend ``--kv-transfer`` names. NOTE: ``nixl_transfer`` imports NIXL only when called, so
    an ``inprocess`` worker runs where the nixl package is missing."""
    if args.kv_transfer == "inprocess":
        return InProcessFabric().transfer_factory
    return nixl_transfer


def prepare_process(args: argparse.Namespace) -> None:
    """Logging, and UCX's devices (before NIXL initialises UCX): loopback-bound workers stay local."""
    environment.use_ucx_devices(args.ucx_net_devices, args.host)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


async def serve_until_signal(
    worker: WorkerRuntime,
    serve: Callable[[WorkerRuntime, str, int], Awaitable[tuple[object, str]]],
    host: str,
    port: int,
) -> None:
    """Serve (the role's ``service.serve``), print ``LISTENING host:port`` (for supervisors and
    tests), stop on SIGINT/SIGTERM. A worker that cannot join the registered pool exits with status
    2 and the reason."""
    try:
        _, address = await serve(worker, host, port)
    except IncompatibleKVLayoutError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    gc_policy.settle_heap()
    print(f"LISTENING {address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await worker.shutdown(grace_s=2.0)
