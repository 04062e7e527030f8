"""``pdserve scale``: change a running service's prefill/decode replica counts in place."""

from __future__ import annotations

import argparse
import logging
import sys


def add_parser(sub) -> None:
    sc = sub.add_parser("scale", help="change a running service's prefill/decode replica counts in place")
    sc.add_argument("--prefill", type=int, default=None, help="prefill replicas")
    sc.add_argument("--decode", type=int, default=None, help="decode replicas")
    sc.add_argument("--address", default=None, help="Ray cluster address (default: the local one)")
    sc.add_argument("--app", default="pdserve", help="Serve application name")
    sc.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import ray

    from deploy.scaling import set_replicas, target_replicas

    counts = {k: v for k, v in (("prefill", args.prefill), ("decode", args.decode)) if v is not None}
    if not counts:
        print("error: give --prefill N and/or --decode M", file=sys.stderr)
        return 2
    ray.init(address=args.address or "auto", logging_level=logging.ERROR, log_to_driver=False)
    try:
        before = target_replicas(args.app)
        if "Autoscaler" in before:
            print("note: the P/D autoscaler is running; it may change these counts again", file=sys.stderr)
        set_replicas(args.app, counts)
        after = target_replicas(args.app)
    finally:
        ray.shutdown()
    for name in ("Prefill", "Decode"):
        if name in before:
            print(f"{name}: {before[name]} -> {after[name]} replicas")
    print("new replicas register before taking traffic; removed ones drain first (see pdserve status)")
    return 0
