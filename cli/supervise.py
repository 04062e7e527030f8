"""``pdserve serve`` under a supervisor: the service and its Ray cluster in a session of their own.

``ray.init`` starts a local cluster's GCS, raylet and workers in the caller's process group. A signal to
the whole group (what ``timeout``, systemd, Kubernetes and a closing terminal send) then reaches them
at the same moment as the CLI: the cluster is gone before the CLI's drain can ask it anything, and
the drain ends in "Failed to connect to GCS" a minute later with the service record left behind.

So the command the user started stays a small supervisor in the user's group, and runs the service
as a child in a new session (``start_new_session``): a group-wide SIGTERM, SIGINT or SIGHUP reaches
only the supervisor, which hands it to the child alone, and the child drains exactly as when it is
signalled by itself. The child dies with the supervisor (``PR_SET_PDEATHSIG``: SIGTERM, so even a
SIGKILLed supervisor leaves a draining service, not an orphaned cluster). The supervisor's exit code
is the child's.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

from settings import environment

_PR_SET_PDEATHSIG = 1
FORWARDED = {signal.SIGINT: signal.SIGINT, signal.SIGTERM: signal.SIGTERM, signal.SIGHUP: signal.SIGTERM}


def supervise(argv: list[str]) -> int | None:
    """Run ``pdserve <argv>`` as a supervised child and return its exit code; None when this process
    is that child already (or the platform has no sessions), so the caller serves itself."""
    supervisor = environment.take_supervisor_pid()
    if supervisor is not None:
        _die_with(supervisor)
        return None
    if os.name != "posix":
        return None
    # The child imports this checkout, never a ``cli`` package of the directory it is started in
    # (-P: no current directory on sys.path; the checkout on PYTHONPATH instead).
    env = environment.python_path_env(str(Path(__file__).resolve().parents[1]))
    env[environment.SUPERVISOR_PID] = str(os.getpid())
    pending: list[int] = []  # signals that came before the child existed
    children: list[subprocess.Popen] = []
    for sig, sent in FORWARDED.items():
        signal.signal(sig, lambda *_, sent=sent: _forward(children, pending, sent))
    sys.stdout.flush()
    child = subprocess.Popen([sys.executable, "-P", "-m", "cli", *argv], env=env, start_new_session=True)
    children.append(child)
    for sig in pending:
        _forward(children, [], sig)
    code = child.wait()  # PEP 475: the handlers run and the wait goes on
    return 128 - code if code < 0 else code  # killed by a signal: the shell's convention


def _forward(children: list[subprocess.Popen], pending: list[int], sig: int) -> None:
    if not children:
        pending.append(sig)
        return
    with contextlib.suppress(ProcessLookupError):
        children[0].send_signal(sig)  # the child alone: its session (the Ray cluster) stays up to drain


def _die_with(supervisor: int) -> None:
    """SIGTERM when the supervisor dies; if it died before this ran, drain right away."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != supervisor:
        os.kill(os.getpid(), signal.SIGTERM)
