"""The faults of ``python -m bench.chaos`` and how it sees the service: a real redis-server it can
kill and restart empty, the replica processes of one service (its session: never anyone else's), the
busiest of them by ``pdserve status``, and whether the service is back at full strength."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.ports import free_port
from bench.standalone_stack import child_pids

FAULTS = ("kill_decode", "stop_decode", "kill_prefill", "stop_prefill", "restart_redis")
DEPLOYMENT = {"decode": "Decode", "prefill": "Prefill"}


class RedisProcess:
    """A real redis-server on a free local port, no persistence: a restart comes back empty."""

    def __init__(self, workdir: Path) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise SystemExit("redis-server is not installed (apt-get install -y redis-server)")
        self.port = free_port()
        self.dir, self.proc = workdir, None
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.start()

    def start(self) -> None:
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen(
            [self.binary, *args, "--dir", str(self.dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


def replica_pids(session: int, role: str) -> list[int]:
    """Live replica processes of ``role`` of one service: ``session`` is its ``pdserve serve``
    (started in a session of its own), whose supervised child leads the session the cluster's
    processes are in (cli/supervise.py)."""
    sessions = {session, *child_pids(session)}
    out = subprocess.run(["ps", "-ww", "-eo", "pid,sid,stat,args"], capture_output=True, text=True).stdout
    title = f"ray::ServeReplica:pdserve:{DEPLOYMENT[role]}"
    pids = []
    for line in out.splitlines()[1:]:
        pid, sid, stat, args = line.split(None, 3)
        if int(sid) in sessions and args.startswith(title) and not stat.startswith("Z"):
            pids.append(int(pid))
    return sorted(pids)


async def registered_workers(session, base: str) -> dict[str, dict[str, float]]:
    """worker id -> {role, free, total, running, waiting} from the service's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    names = {
        "pdserve_kv_blocks_free": "free",
        "pdserve_kv_blocks": "total",
        "pdserve_requests_running": "running",
        "pdserve_requests_waiting": "waiting",
    }
    async with session.get(base + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, dict] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in names and s.labels.get("role") in ("prefill", "decode"):
                w = out.setdefault(s.labels["worker"], {"role": s.labels["role"]})
                w[names[s.name]] = s.value
    return out


ROUTER_COUNTERS = {
    "pdserve_router_migrations_total": "moved",
    "pdserve_router_stalls_total": "stalls",
    "pdserve_router_migrations_refused_total": "refused",
}


async def router_counters(session, base: str) -> dict[str, float]:
    """The router's migration counters (``moved``, ``stalls``, ``refused``) from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    async with session.get(base + "/metrics") as resp:
        text = await resp.text()
    out = dict.fromkeys(ROUTER_COUNTERS.values(), 0.0)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in ROUTER_COUNTERS:
                out[ROUTER_COUNTERS[s.name]] = s.value
    return out


def busiest_replica(base: str, session_id: int, role: str, rng) -> int | None:
    """The pid of the ``role`` worker with the most requests (``pdserve status`` of the service at
    ``base``), among this session's replicas: a fault that hits an idle worker tests nothing."""
    own = replica_pids(session_id, role)
    out = subprocess.run(
        [sys.executable, "-m", "cli", "status", "--endpoint", base, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        workers = json.loads(out.stdout.strip().splitlines()[-1])["workers"]
    except (ValueError, IndexError, KeyError):
        return rng.choice(own) if own else None

    def load(w: dict) -> int:
        st = w.get("stats", {})
        return st.get("numRunning", 0) + st.get("numWaiting", 0) + st.get("numHeldRequests", 0)

    ranked = sorted((w for w in workers if w["role"] == role and w["pid"] in own), key=load, reverse=True)
    return ranked[0]["pid"] if ranked else (rng.choice(own) if own else None)


async def inject(
    kind: str,
    base: str,
    session_id: int,
    redis: RedisProcess,
    stall_s: float,
    rng,
    strike: Callable[[], None],
) -> str:
    """Inflict ``kind``; ``strike()`` is called at the moment it lands (the victim chosen)."""
    if kind == "restart_redis":
        strike()
        redis.kill()
        await asyncio.to_thread(redis.start)
        return "redis"
    action, role = kind.split("_")
    victim = await asyncio.to_thread(busiest_replica, base, session_id, role, rng)
    if victim is None:
        return "none"
    strike()
    if action == "kill":
        os.kill(victim, signal.SIGKILL)
    else:
        os.kill(victim, signal.SIGSTOP)
        await asyncio.sleep(stall_s)  # the stall's length is the fault itself, not a guess
        with contextlib.suppress(ProcessLookupError):  # Serve may have replaced it meanwhile
            os.kill(victim, signal.SIGCONT)
    return f"{role} pid {victim}"


async def wait_full_strength(
    http, base, session_id: int, expect: dict[str, int], timeout_s: float
) -> tuple[bool, str]:
    """Wait until every expected worker is registered and every replica process alive; (whether it
    happened in time, the last state seen)."""
    deadline = time.monotonic() + timeout_s
    state = ""
    while time.monotonic() < deadline:
        try:
            workers = await registered_workers(http, base)
        except Exception as exc:  # the ingress itself may be restarting
            workers, state = {}, f"/metrics failed: {exc}"
        roles = [w["role"] for w in workers.values()]
        pids = {r: replica_pids(session_id, r) for r in expect}
        if all(roles.count(r) == n and len(pids[r]) == n for r, n in expect.items()):
            return True, ""
        state = state or f"registered {sorted(workers)}, replica processes {pids}"
        await asyncio.sleep(0.25)
    return False, state
