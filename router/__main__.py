"""``python -m router --redis-url URL [--policy cache_aware] [--port N]``: the router on its own.

Prints ``LISTENING <host:port>`` once it serves. The Redis URL (``redis://`` or ``rediss://``, AUTH in
the URL) may come from the environment as PDSERVE_REDIS_URL, so no secret lands on a command line.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from registry.cluster_view import ClusterView
from router.decode_relay import KV_STREAMING_TOKENS
from router.migration import MigrationOptions
from router.policies import POLICIES
from router.router import Router
from router.service import serve
from settings import environment, event_loop


async def _main(args: argparse.Namespace) -> None:
    view = ClusterView(args.redis_url)
    view.start()
    view.wait_synced(10)
    migration = MigrationOptions(
        max_migrations=args.max_migrations,
        stall_timeout_s=args.stall_timeout,
        stall_floor_s=args.stall_floor,
        stall_step_multiple=args.stall_step_multiple,
    )
    router = Router(
        view,
        args.policy,
        local_prefill_tokens=args.local_prefill_tokens,
        migration=migration,
        kv_streaming_tokens=args.kv_streaming_tokens,
        peer_reads=args.peer_reads,
    )
    server, address = await serve(router, args.host, args.port)
    print(f"LISTENING {address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=2)
    await router.close()
    view.stop()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m router", description=__doc__)
    p.add_argument(
        "--redis-url",
        default=environment.redis_url(),
        required=environment.redis_url() is None,
        help="registry Redis (env PDSERVE_REDIS_URL)",
    )
    p.add_argument("--policy", default="cache_aware", choices=POLICIES)
    p.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=0,
        help="prefill on the decode worker when its uncached prompt part is at most this many tokens (0: never)",
    )
    p.add_argument(
        "--peer-reads",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a worker computing a prompt (a prefill worker, or a decode worker serving aggregated) may read its prefix from another worker of its role's KV tiers over NIXL when that is cheaper than computing it (cache_aware routing; needs kv_host_cache_gib)",
    )
    p.add_argument(
        "--kv-streaming-tokens",
        type=int,
        default=KV_STREAMING_TOKENS,
        help="the decode worker reads a prompt's KV while it is prefilled when at least this many of its "
        "tokens are uncached (0: the KV moves after the prefill)",
    )
    defaults = MigrationOptions()
    p.add_argument(
        "--max-migrations",
        type=int,
        default=defaults.max_migrations,
        help="times a request may move to another decode worker when its own is lost mid-stream (0: never)",
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=None,
        help="seconds a decode stream may stay silent before its worker counts as stalled "
        "(default: derived from the worker's step time, see --stall-floor)",
    )
    p.add_argument(
        "--stall-floor",
        type=float,
        default=defaults.stall_floor_s,
        help="the derived stall deadline is never shorter than this (seconds)",
    )
    p.add_argument(
        "--stall-step-multiple",
        type=float,
        default=defaults.stall_step_multiple,
        help="the derived stall deadline: this many times the worker's longest recent engine step",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=0)
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
