"""``pdserve scale``: change a running service's prefill/decode replica counts in place."""

from __future__ import annotations

import argparse
import sys

from cli.service_target import add_target_args, choose_target


def add_parser(sub) -> None:
    sc = sub.add_parser("scale", help="change a running service's prefill/decode replica counts in place")
    sc.add_argument("--prefill", type=int, default=None, help="prefill replicas")
    sc.add_argument("--decode", type=int, default=None, help="decode replicas")
    sc.add_argument(
        "--allow-pending",
        action="store_true",
        help="scale up even when the cluster has no room yet (one whose autoscaler adds nodes)",
    )
    add_target_args(sc)
    sc.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import ray

    from cli.ray_cluster import connect
    from deploy.scaling import check_room, set_replicas, target_replicas

    counts = {k: v for k, v in (("prefill", args.prefill), ("decode", args.decode)) if v is not None}
    if not counts:
        print("error: give --prefill N and/or --decode M", file=sys.stderr)
        return 2
    target = choose_target(args)
    print(f"scaling {target.describe()}", flush=True)
    connect(target)
    try:
        before = target_replicas(target.app_name)
        if "Autoscaler" in before:
            print("note: the P/D autoscaler is running; it may change these counts again", file=sys.stderr)
        if not args.allow_pending:
            check_room(target.app_name, counts, ray.available_resources())
        set_replicas(target.app_name, counts)
        after = target_replicas(target.app_name)
    except ValueError:
        raise
    except Exception as exc:  # e.g. no Serve instance on that cluster
        first = next((x.strip() for x in str(exc).splitlines() if x.strip()), type(exc).__name__)
        raise ConnectionError(f"Serve on {target.ray_address} did not take the change: {first}") from None
    finally:
        ray.shutdown()
    for name in ("Prefill", "Decode"):
        if name in before:
            print(f"{name}: {before[name]} -> {after[name]} replicas")
    print("new replicas register before taking traffic; removed ones drain first (see pdserve status)")
    return 0
