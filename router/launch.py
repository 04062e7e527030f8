"""The router as a command builds it: its flags and the router they configure, shared by
``python -m router`` (the router on its own) and ``python -m ingress --redis-url`` (the router inside
the HTTP process, as ``pdserve serve``'s router replicas serve HTTP by default)."""

from __future__ import annotations

import argparse

from registry.cluster_view import ClusterView
from router.decode_relay import KV_STREAMING_TOKENS
from router.migration import MigrationOptions
from router.policies import POLICIES
from router.router import Router
from settings import environment


def add_router_flags(p: argparse.ArgumentParser, redis_required: bool = True) -> None:
    """The routing flags (``--redis-url``, policy, migration, KV streaming), for ``build_router``."""
    p.add_argument(
        "--redis-url",
        default=environment.redis_url(),
        required=redis_required and environment.redis_url() is None,
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


def build_router(args: argparse.Namespace) -> Router:
    """A router over a started, synced view of the registry at ``args.redis_url``, configured by the
    flags of ``add_router_flags`` (``router.close()`` then ``router.view.stop()`` end it)."""
    view = ClusterView(args.redis_url)
    view.start()
    view.wait_synced(10)
    migration = MigrationOptions(
        max_migrations=args.max_migrations,
        stall_timeout_s=args.stall_timeout,
        stall_floor_s=args.stall_floor,
        stall_step_multiple=args.stall_step_multiple,
    )
    return Router(
        view,
        args.policy,
        local_prefill_tokens=args.local_prefill_tokens,
        migration=migration,
        kv_streaming_tokens=args.kv_streaming_tokens,
        peer_reads=args.peer_reads,
    )
