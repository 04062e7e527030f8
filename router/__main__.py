"""``python -m router --redis-url URL [--policy cache_aware] [--port N]``: the router on its own.

Prints ``LISTENING <host:port>`` once it serves. The Redis URL (``redis://`` or ``rediss://``, AUTH in
the URL) may come from the environment as PDSERVE_REDIS_URL, so no secret lands on a command line.
``python -m ingress --redis-url URL`` runs the same router inside the HTTP process instead (the
flags below, less ``--host``/``--port``, are its too).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from router.launch import add_router_flags, build_router
from router.service import serve
from settings import event_loop, gc_policy


async def _main(args: argparse.Namespace) -> None:
    router = build_router(args)
    server, address = await serve(router, args.host, args.port, args.socket_streams)
    gc_policy.settle_heap()
    print(f"LISTENING {address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=2)
    await router.close()
    router.view.stop()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m router", description=__doc__)
    add_router_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=0)
    p.add_argument(
        "--socket-streams",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also serve the front ends' Generate call stream on a plain socket beside gRPC "
        "(framed protobuf, same host; front ends find it in the cluster state and prefer it)",
    )
    p.add_argument("--log-level", default="WARNING")
    return p


def main() -> None:
    args = build_parser().parse_args()
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    event_loop.run(_main(args))


if __name__ == "__main__":
    main()
