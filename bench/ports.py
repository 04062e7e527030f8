"""Free loopback ports for servers a test or benchmark starts, chosen where nothing else takes them.

A port the kernel hands out for ``bind(0)`` comes from the ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default), the same range every
outgoing connection and every other ``bind(0)`` draws from. A server that starts seconds after its
port was chosen (Ray, then Serve's proxy) can find it taken by then. Ports here come from below
the ephemeral range and above Ray's worker ports (10002-19999), so only someone choosing the same
port on purpose can collide, and a random pick makes that unlikely between parallel test workers.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

RAY_WORKER_PORTS_END = 20000
_used: set[int] = set()


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that nothing listens on, outside the ephemeral range when it can be."""
    low, high = RAY_WORKER_PORTS_END, _ephemeral_start()
    if high - low >= 1000:
        for _ in range(200):
            port = random.randrange(low, high)
            if port not in _used and _bindable(host, port):
                _used.add(port)
                return port
    with socket.socket() as s:  # a kernel with an unusual range: its choice
        s.bind((host, 0))
        return s.getsockname()[1]
