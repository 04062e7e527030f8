"""``pdserve serve`` on a port something already listens on is refused at once with one line (it
used to start a second service sharing the port, or a 45-line Ray traceback), before any Ray or
Redis is started; a port in use by nothing is not refused by the check."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cli.host_share import check_port_free

ROOT = Path(__file__).resolve().parents[2]


def test_serve_on_a_taken_port_is_one_line_and_starts_nothing(tmp_path):
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as pdserve's own HTTP servers do
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = dict(os.environ, PYTHONPATH=str(ROOT), HOME=str(tmp_path))  # no service record of ours
        done = subprocess.run(
            [sys.executable, "-m", "cli", "serve", "--model", "unused", "--port", str(port)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and f"port {port} on 127.0.0.1 is taken" in done.stderr
    assert "ray" not in done.stdout.lower() and "redis" not in done.stdout.lower()


def test_the_check_passes_a_free_port_and_port_zero():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    check_port_free("127.0.0.1", port)  # closed again: free
    check_port_free("127.0.0.1", 0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        with pytest.raises(ValueError, match="is taken"):
            check_port_free("127.0.0.1", port)
