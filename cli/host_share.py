"""How a ``pdserve serve`` on this host shares its cores: torch threads per CPU engine, and how many
front-end (HTTP) processes serve the port."""

from __future__ import annotations

import argparse
import os
import socket

# One front end per this many cores: a front end (HTTP, tokenization, detokenization, SSE, and in
# the default layout the router) keeps about one core busy at full load on a GPU host (issue 31's
# H100 profile: ingress 0.65-1.1 cores), and the engine processes need the rest.
CORES_PER_FRONTEND = 8


def local_cpu_threads(args: argparse.Namespace) -> int | None:
    """The torch threads of each CPU engine of a cluster started here: the cores this process may use
    (or ``--ray-cpus``, when fewer), shared out among the workers. Without it a replica gets Ray's
    OMP_NUM_THREADS (its reserved CPUs, 1 by default), which leaves cores idle when there are fewer
    workers than cores. ``--ray-cpus`` above the cores (room for more replicas) adds no threads:
    more threads than cores make OpenMP's teams wait on each other (measured on 2 cores: a
    speculating decode worker's test ran 5x slower with 2 threads per engine than with 1). None: not
    ours to pick (given, a GPU engine, or a cluster elsewhere)."""
    if args.cpu_threads is not None or args.device != "cpu" or args.address:
        return args.cpu_threads
    workers = args.decode + (args.prefill if args.mode == "disaggregated" else 0)
    return max(1, local_cores(args) // max(1, workers))


def local_cores(args: argparse.Namespace) -> int:
    """The cores a local cluster's processes share: those this process may use, or ``--ray-cpus``
    when fewer (Ray CPUs above the cores are room for replicas, not cores to run on)."""
    return min(args.ray_cpus or usable_cores(), usable_cores())


def usable_cores() -> int:
    """The cores this process may run on (a container's cpuset, ``taskset``), not the host's count:
    more torch threads than cores makes OpenMP's threads wait on each other (bench/README.md)."""
    return len(os.sched_getaffinity(0)) or 1


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def frontend_count(args: argparse.Namespace) -> int:
    """``--frontends``, else one per ``CORES_PER_FRONTEND`` cores this process may use (1 on a small
    machine, where a second HTTP process only takes cores from the engine)."""
    if args.frontends is not None:
        return args.frontends
    return max(1, local_cores(args) // CORES_PER_FRONTEND)


def check_port_free(host: str, port: int) -> None:
    """ValueError (one line from ``pdserve``) when something already listens on ``host:port``: a
    second service there would share the port with the first (SO_REUSEPORT), or fail deep in Ray.
    Port 0 picks a free one; a socket left in TIME_WAIT does not count as taken."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ValueError(
                f"port {port} on {host} is taken ({exc.strerror}): stop what serves there "
                "(`pdserve status` lists pdserve services) or choose another --port"
            ) from None
