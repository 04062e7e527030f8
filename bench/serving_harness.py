"""What every serving benchmark here needs: a ``pdserve serve`` it starts and stops, the load
generator's arguments, and one closed-loop run against it."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading

from loadgen.serving_client import add_bench_args, run_load
from loadgen.serving_datasets import build

VOCAB = 8192  # the default tiny model's vocabulary


@contextlib.contextmanager
def serving(*flags: str):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    env.pop("PDSERVE_REDIS_URL", None)
    env.pop("PDSERVE_API_KEY", None)
    cmd = [sys.executable, "-m", "cli", "serve", "--port", str(port), *flags]
    print(f"\n$ pdserve serve {' '.join(flags)}", flush=True)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    ready = threading.Event()
    lines: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "pdserve is serving" in line:
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        if not ready.wait(300):
            raise RuntimeError("server did not start:\n" + "".join(lines[-30:]))
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


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
