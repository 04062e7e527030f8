"""The standalone processes of a served-path benchmark (``bench.served_path``): children that print
``LISTENING host:port`` or serve HTTP, waited for on conditions (never a fixed sleep), stopped
together on the way out (SIGTERM, then SIGKILL after a grace period), and a Redis for each layout
(embedded, or a ``redis-server`` child). Everything binds to 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc

from bench import ports
from cli.embedded_redis import EmbeddedRedis
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

HOST = "127.0.0.1"


def free_port() -> int:
    return ports.free_port(HOST)


def accepts(port: int) -> bool:
    with socket.create_connection((HOST, port), timeout=1):
        return True


def child_pids(pid: int) -> list[int]:
    """The processes ``pid`` started (``/proc/<pid>/task/*/children``): a worker's engine process, a
    supervised ``pdserve serve``'s service. Empty once ``pid`` is gone."""
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):  # a thread that just ended
                out += [int(c) for c in (task / "children").read_text().split()]
    return out


def http(url: str, body: dict | None = None) -> bytes:
    """GET ``url``, or POST ``body`` as JSON; an answer other than 2xx raises (HTTPError)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.read()


class Child:
    """A child process; a thread keeps its output (stdout and stderr) so the pipe never fills."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        self.name, self.address, self.lines = name, "", []
        pipe = subprocess.PIPE  # stderr joins it: one stream to drain, and to show if the process fails
        self.proc = subprocess.Popen(cmd, stdout=pipe, stderr=subprocess.STDOUT, text=True, env=env)
        threading.Thread(target=self._pump, name=f"out-{name}", daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("LISTENING ") and not self.address:
                self.address = line.split()[1]


class Processes:
    """The child processes of one layout. Leaving the block stops them all, on error too: SIGTERM to
    each, then SIGKILL to any still running after ``grace_s``."""

    def __init__(self, start_timeout_s: float, grace_s: float = 20.0) -> None:
        self.children: list[Child] = []
        self.start_timeout_s, self.grace_s = start_timeout_s, grace_s
        self.env = {k: v for k, v in os.environ.items() if k not in ("PDSERVE_REDIS_URL", "PDSERVE_API_KEY")}

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> Child:
        print(f"  $ {' '.join(cmd)}", flush=True)
        self.children.append(Child(name, cmd, {**self.env, **(env or {})}))
        return self.children[-1]

    def serve(self, module: str, *flags: str) -> str:
        """``python -m module flags`` until it prints ``LISTENING host:port``; returns that address."""
        child = self.start(module, [sys.executable, "-m", module, *flags])
        return str(self.wait(lambda: child.address, f"LISTENING line from {module}"))

    def wait(self, ready: Callable[[], object], what: str, timeout_s: float | None = None) -> object:
        """Poll ``ready()`` until it gives a true value (an OSError: not yet) while every child lives."""
        deadline, last = time.monotonic() + (timeout_s or self.start_timeout_s), None
        while True:
            for child in self.children:
                if child.proc.poll() is not None:
                    tail = "".join(child.lines[-30:])
                    raise RuntimeError(f"{child.name} exited ({child.proc.returncode}), saying:\n{tail}")
            try:
                value = ready()
                if value:
                    return value
            except (OSError, ValueError, KeyError, IndexError) as exc:  # URLError, HTTPError: OSErrors
                last = exc
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout_s or self.start_timeout_s:.0f}s ({last})")
            time.sleep(0.1)  # a poll interval: every wait here ends on its condition

    def pids(self) -> dict[str, int]:
        return {c.name: c.proc.pid for c in self.children}

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        for child in self.children:
            if child.proc.poll() is None:
                child.proc.terminate()
        deadline = time.monotonic() + self.grace_s
        for child in self.children:
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"  {child.name} did not stop within {self.grace_s:.0f}s: killed", flush=True)
                child.proc.kill()
                child.proc.wait()


@contextlib.contextmanager
def redis(server: str | None, start_timeout_s: float):
    """(URL, pid of the redis-server child or None) of a fresh Redis for one layout."""
    if server is None:
        with EmbeddedRedis(HOST) as embedded:
            yield embedded.url, None
        return
    port = free_port()
    with Processes(start_timeout_s) as procs, tempfile.TemporaryDirectory() as tmp:
        cmd = [server, "--port", str(port), "--bind", HOST, "--save", "", "--dir", tmp]
        child = procs.start("redis", cmd)
        procs.wait(lambda: accepts(port), "Redis port")
        yield f"redis://{HOST}:{port}/0", child.proc.pid


def wait_http(base: str, procs: Processes) -> str:
    """Wait until ``/health`` answers, ``/v1/models`` names the model and a two-token completion
    comes back (so the router sees a worker); returns the served model name."""
    procs.wait(lambda: http(base + "/health"), f"{base}/health")
    model = json.loads(http(base + "/v1/models"))["data"][0]["id"]
    body = {"model": model, "prompt": [3, 4, 5, 6], "max_tokens": 2, "temperature": 0}
    procs.wait(lambda: http(base + "/v1/completions", body), "a first completion")
    return model


def engine_stats(address: str, role: str = "decode_worker") -> pb.EngineStats:
    stub_cls = pb_grpc.PrefillWorkerStub if role == "prefill_worker" else pb_grpc.DecodeWorkerStub
    with grpc.insecure_channel(address) as channel:
        return stub_cls(channel).GetState(pb.GetStateRequest(), timeout=10).stats


def free_blocks(address: str, role: str) -> int:
    return engine_stats(address, role).num_free_blocks


def check_blocks(procs: Processes, workers: dict[str, str], before: dict[str, int]) -> dict:
    """Each worker's free KV blocks against its count before the first request, once back (a prefill
    worker frees a prompt's blocks when the decode worker's notification arrives) or after 15 s."""
    now = {}

    def back() -> bool:
        now.update({name: free_blocks(addr, name) for name, addr in workers.items()})
        return now == before

    with contextlib.suppress(TimeoutError):
        procs.wait(back, "free KV blocks back", timeout_s=15)
    for name in workers:
        if now[name] != before[name]:
            print(f"  !!! KV BLOCKS NOT RETURNED: {name}: {now[name]} free, {before[name]} before")
    return {name: {"free_before": before[name], "free_after": now[name]} for name in workers}
