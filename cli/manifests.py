"""``pdserve manifests``: render the KubeRay RayService, Redis and Serve config from a values file."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    mf = sub.add_parser(
        "manifests", help="render the KubeRay RayService, Redis and Serve config from a values file"
    )
    mf.add_argument("--values", default="deploy/kuberay/values.yaml", help="the values file")
    mf.add_argument("--out", default="deploy/kuberay", help="output directory")
    mf.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from deploy.manifests import write

    for path in write(Path(args.values), Path(args.out)):
        print(f"wrote {path}")
    return 0
