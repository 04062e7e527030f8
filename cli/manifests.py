"""``pdserve manifests``: render the KubeRay RayService, Redis and Serve config from a values file."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    mf = sub.add_parser(
        "manifests", help="render the KubeRay RayService, Redis and Serve config from a values file"
    )
    mf.add_argument(
        "--values",
        default=None,
        help="the values file (default: the example shipped with pdserve, to copy and edit)",
    )
    mf.add_argument("--out", default="deploy/kuberay", help="output directory")
    mf.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Everything is rendered before anything is written: a bad values file leaves no file or
    directory behind (``ValueError``: one line from ``pdserve``, exit status 2)."""
    from deploy.manifests import default_values, write

    values = Path(args.values) if args.values else default_values()
    if not values.is_file():
        raise ValueError(
            f"values file {values} not found (omit --values for the example shipped with pdserve)"
        )
    for path in write(values, Path(args.out)):
        print(f"wrote {path}")
    return 0
