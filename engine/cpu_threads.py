"""Which thread may own torch's CPU thread pool: a serving engine keeps it to its own loop thread.

torch's CPU wheels parallelise ops with GNU OpenMP (libgomp). Every thread that runs a parallel op
becomes the master of a team of its own, and the team's workers live as long as that thread. Once
the process holds more OpenMP threads than the machine has cores, libgomp stops letting idle
workers spin (1,000 spins instead of 300,000) and sends them to sleep after every op, so each of the
hundreds of small parallel ops in a forward pass pays a futex wake-up. Measured on a 2-core machine
with 2 torch threads: an element-wise op over 32 x 2048 floats takes 21 us on the only team's master
and 150 us on a second thread once the first one has a team; a whole 16-token prefill step of the
default tiny model, 11.4 ms against 19.2 ms.

A worker builds its engine (weights loaded, the KV pool filled: parallel ops) on one thread and
steps it on another, the engine loop's. ``build_off_thread`` runs the construction on a thread that
ends right after, taking its team with it, so the engine loop's thread is the process's only master.

On a GPU the host's torch ops are small (batch building, sampling bookkeeping) and a team of one
thread per host core only spins: measured on a 16-core H100 host, the engine alone ran 2.9x slower
with torch's default pool than with one thread, and kept 7-14 cores busy. ``intra_op_threads``
is the policy every engine applies when it is built: one thread on an accelerator unless told
otherwise, the configured count on a CPU, else torch's own.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


def intra_op_threads(device_type: str, configured: int | None) -> int | None:
    """The torch intra-op thread count an engine on ``device_type`` runs with (None: torch's own)."""
    if configured is not None:
        return configured
    return None if device_type == "cpu" else 1


def apply_thread_policy(device_type: str, configured: int | None) -> None:
    """Set the process's torch intra-op pool for an engine on ``device_type`` (see the module doc)."""
    threads = intra_op_threads(device_type, configured)
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def build_off_thread(factory: Callable[[], T], name: str = "engine-build") -> T:
    """``factory()``, run on a new thread that is gone (with any OpenMP team it made) on return."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix=name) as pool:  # exits joining it
        return pool.submit(factory).result()
