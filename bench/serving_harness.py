"""What every serving benchmark here needs: a ``pdserve serve`` it starts and stops, the load
generator's arguments, and one closed-loop run against it."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

from bench.ports import free_port
from loadgen.serving_client import add_bench_args, run_load
from loadgen.serving_datasets import build

VOCAB = 8192  # the default tiny model's vocabulary


@contextlib.contextmanager
def serving(*flags: str):
    """``pdserve serve FLAGS`` on a free port until the block ends; yields its base URL."""
    with serving_process(*flags) as (base, _):
        yield base


@contextlib.contextmanager
def serving_process(*flags: str, env: dict[str, str] | None = None):
    """``pdserve serve FLAGS`` on a free port until the block ends; yields (base URL, its process).
    The server runs in its own session (its session id is its pid), so every process it starts can
    be told from anyone else's. A port taken between choosing it and the server binding it (Ray's
    own processes pick ports as they start) is chosen again."""
    print(f"\n$ pdserve serve {' '.join(flags)}", flush=True)
    for attempt in range(3):
        proc, port, lines = _start(flags, env or {})
        if port is not None:
            break
        # Serve's proxy says "Failed to bind"; a direct ingress that cannot bind fails its deployment.
        taken = ("Failed to bind", "Address already in use", "the deployments ['Ingress']")
        if attempt == 2 or not any(t in line for line in lines for t in taken):
            raise RuntimeError("server did not start:\n" + "".join(lines[-30:]))
        print("  its port was taken meanwhile: again on another", flush=True)
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _start(
    flags: tuple[str, ...], extra_env: dict[str, str]
) -> tuple[subprocess.Popen, int | None, list[str]]:
    """The server process, its port once it serves (None if it exited first), and its output."""
    port = free_port()
    env = dict(os.environ)
    env.pop("PDSERVE_REDIS_URL", None)
    env.pop("PDSERVE_API_KEY", None)
    env.update(extra_env)
    cmd = [sys.executable, "-m", "cli", "serve", "--port", str(port), *flags]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    ready, ended = threading.Event(), threading.Event()
    lines: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "pdserve is serving" in line:
                ready.set()
        ended.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + 300
    while not ready.wait(0.5):
        if ended.is_set() or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            return proc, None, lines
    return proc, port, lines


def bench_args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_bench_args(p)
    args = p.parse_args(["--base-url", "http://unused"])
    for k, v in kw.items():
        setattr(args, k, v)
    args.api_key = None
    args.goodput = kw.get("goodput", {})
    return args


def load(base: str, args: argparse.Namespace, concurrency: int) -> dict:
    import asyncio

    args.base_url = base
    return asyncio.run(run_load(args, build(args), concurrency, None))
