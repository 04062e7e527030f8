"""The front end's CPU on a host it shares with the engines (issue 34): what ``pdserve profile
--served`` measures when the deployment runs on this machine, for the simulator's shared cores.

A served request costs CPU outside the engines' steps: HTTP, the router, the workers' gRPC sides,
streaming each token back, Ray's own processes. At low load that is delay (``ServedOverhead``'s
latency terms); on a CPU host under load it is cores taken from the engines. ``usage`` reads
Linux's ``/proc`` (the machine's busy CPU time, each engine process's, ``*.engine_host``, and this
process's own: the client measuring it); ``between`` two readings, the front end is the machine
less the engines and the client.
"""

from __future__ import annotations

import os
from pathlib import Path

ENGINE_MARK = b".engine_host"  # the engine processes' module: prefill_worker.engine_host, decode_...
_TICK = os.sysconf("SC_CLK_TCK")


def available() -> bool:
    return Path("/proc/stat").exists()


def usage() -> dict:
    """A reading of where the machine's CPU went so far: ``machine`` (busy seconds), ``engines``
    (each engine process's seconds, by pid) and ``self`` (this process's). Two readings make a
    ``between``."""
    engines = {pid: _process_cpu_s(pid) for pid in _engine_pids()}
    return {"machine": _machine_busy_s(), "engines": engines, "self": _process_cpu_s("self")}


def between(before: dict, after: dict) -> dict:
    """CPU seconds between two ``usage`` readings: ``machine``, ``engines`` (each engine process's,
    by pid; one started meanwhile counts from its start) and ``front``: the rest, less this process
    (never below 0: an engine process that ended meanwhile took its last seconds with it)."""
    engines = {pid: cpu - before["engines"].get(pid, 0.0) for pid, cpu in after["engines"].items()}
    machine = after["machine"] - before["machine"]
    front = machine - sum(engines.values()) - (after["self"] - before["self"])
    return {"machine": machine, "engines": engines, "front": max(front, 0.0)}


def cores_between(before: dict, after: dict, seconds: float) -> dict:
    """Cores each part kept busy between two ``usage`` readings ``seconds`` apart (engines busiest
    first)."""
    spent = between(before, after)
    return {
        "machine": spent["machine"] / seconds,
        "engines": sorted((e / seconds for e in spent["engines"].values()), reverse=True),
        "front": spent["front"] / seconds,
    }


def _machine_busy_s(stat: str | None = None) -> float:
    """CPU seconds this machine's cores spent on work (``stat``: /proc/stat's text, read if None):
    user, nice, system, irq and softirq. Not idle, iowait or steal: steal is time the hypervisor
    gave another guest, which no process here spent (it read as the front end's CPU)."""
    text = Path("/proc/stat").read_text() if stat is None else stat
    fields = [int(x) for x in text.splitlines()[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, _steal = fields
    return (user + nice + system + irq + softirq) / _TICK


def _process_cpu_s(pid) -> float:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone meanwhile
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def _engine_pids() -> list[str]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if ENGINE_MARK in cmdline:
            out.append(entry.name)
    return out
