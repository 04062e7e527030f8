"""Where a running ``pdserve serve`` can be found: one record file per service.

A record's life: ``serve`` writes it once its Ray cluster is up (``<name>.json``, mode 0600: it
holds the cluster's auth token) -> ``status`` / ``scale`` read it to reach that service's cluster,
never another's -> ``serve`` removes it on its way out. A record left by a ``serve`` that was
killed is stale: its process is gone or its Ray cluster no longer answers. Whoever finds one says
so and removes it.

Records live in ``~/.cache/pdserve/services`` (the directory 0700, each file 0600).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ServiceRecord:
    name: str
    app_name: str  # the Serve application
    endpoint: str  # base URL of the HTTP API (without /v1)
    ray_address: str  # the cluster's GCS address, host:port
    pid: int  # the ``pdserve serve`` process
    pid_start: str = ""  # that process's start time (/proc), so a reused pid is not taken for it
    started_at: float = 0.0
    # NOTE: a secret: kept out of repr (and so out of any log or error message).
    auth_token: str | None = field(default=None, repr=False)

    def describe(self) -> str:
        """One line naming the service for operators; never the token."""
        return f"service {self.name!r} (endpoint {self.endpoint}, Ray cluster {self.ray_address})"


def records_dir() -> Path:
    return Path.home() / ".cache" / "pdserve" / "services"


def check_name(name: str) -> str:
    if not name or name.startswith(".") or any(c in name for c in "/\\\0") or len(name) > 100:
        raise ValueError(f"invalid service name {name!r}: use letters, digits, '-', '_' or '.'")
    return name


def record_path(name: str, directory: Path | None = None) -> Path:
    return (directory or records_dir()) / f"{check_name(name)}.json"


def write_record(record: ServiceRecord, directory: Path | None = None) -> Path:
    """Atomically, readable by this user only (the file may hold the Ray auth token)."""
    path = record_path(record.name, directory)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(record), f)
    os.replace(tmp, path)
    return path


def remove_record(name: str, directory: Path | None = None, pid: int | None = None) -> None:
    """Remove ``name``'s record; with ``pid``, only if that process wrote it (a newer one stays)."""
    path = record_path(name, directory)
    if pid is not None:
        record = read_record(path)
        if record is not None and record.pid != pid:
            return
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def read_record(path: Path) -> ServiceRecord | None:
    """The record at ``path``; None if it is missing or not a record (a half-written or foreign file)."""
    try:
        data = json.loads(path.read_text())
        return ServiceRecord(**data)
    except (OSError, ValueError, TypeError):
        return None


def load_records(directory: Path | None = None) -> list[ServiceRecord]:
    directory = directory or records_dir()
    if not directory.is_dir():
        return []
    records = (read_record(p) for p in sorted(directory.glob("*.json")))
    return [r for r in records if r is not None]


def claim_name(name: str, directory: Path | None = None) -> str:
    """``name`` for a new service; ValueError while a live service holds it (a stale record goes)."""
    record = read_record(record_path(name, directory))
    if record is not None and stale_reason(record) is None:
        raise ValueError(
            f"a pdserve service named {name!r} is already running ({record.describe()}); "
            "stop it or choose another --name"
        )
    return name


def process_start(pid: int) -> str:
    """A process's start time in clock ticks since boot ('' where /proc is not there)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the command name may hold spaces


def new_record(
    name: str, app_name: str, endpoint: str, ray_address: str, auth_token: str | None
) -> ServiceRecord:
    pid = os.getpid()
    return ServiceRecord(
        name=name,
        app_name=app_name,
        endpoint=endpoint,
        ray_address=ray_address,
        pid=pid,
        pid_start=process_start(pid),
        started_at=time.time(),
        auth_token=auth_token,
    )


def stale_reason(record: ServiceRecord, connect_timeout_s: float = 2.0) -> str | None:
    """Why ``record`` no longer describes a running service, or None if it still does."""
    if not _process_alive(record.pid, record.pid_start):
        return f"its pdserve serve process ({record.pid}) is gone"
    if not address_reachable(record.ray_address, connect_timeout_s):
        return f"its Ray cluster at {record.ray_address} does not answer"
    return None


def _process_alive(pid: int, start: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return not start or process_start(pid) in ("", start)


def address_reachable(address: str, timeout_s: float = 2.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False
