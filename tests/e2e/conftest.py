"""Worker processes for the disaggregated-serving tests: each worker runs in its own process, exactly
as in production (``python -m prefill_worker`` / ``python -m decode_worker``), talking real gRPC and
real NIXL (UCX over DRAM)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

START_TIMEOUT_S = 120


@dataclass
class WorkerProc:
    role: str
    proc: subprocess.Popen
    address: str
    args: list[str] = field(default_factory=list)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def start_worker(role: str, model_dir, *extra: str, num_blocks: int = 64, block_size: int = 8) -> WorkerProc:
    module = {"prefill": "prefill_worker", "decode": "decode_worker"}[role]
    args = [
        sys.executable,
        "-m",
        module,
        "--model",
        str(model_dir),
        "--num-blocks",
        str(num_blocks),
        "--block-size",
        str(block_size),
        "--worker-id",
        f"{role}-test",
        *extra,
    ]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=None, text=True, env={**os.environ})
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("LISTENING "):
            return WorkerProc(role, proc, line.split()[1], args)
        if not line and proc.poll() is not None:
            raise RuntimeError(f"{module} exited with {proc.returncode} before serving")
    proc.kill()
    raise RuntimeError(f"{module} did not start within {START_TIMEOUT_S}s")


@pytest.fixture
def workers(tiny_llama):
    """``spawn(role, *flags, model=None)`` -> a running worker process (of ``tiny_llama`` unless
    ``model`` names another checkpoint); all are stopped after the test."""
    started: list[WorkerProc] = []

    def spawn(role: str, *extra: str, model=None, **kw) -> WorkerProc:
        w = start_worker(role, model or tiny_llama, *extra, **kw)
        started.append(w)
        return w

    yield spawn
    for w in started:
        w.stop()
