"""Which running service ``status`` / ``scale`` act on.

The choice, first match wins: ``--service NAME`` (that service's record) -> ``--endpoint URL`` (the
record of the service serving there) -> ``--address HOST:PORT`` (the record of that Ray cluster if
there is one, else that cluster with Ray's own token sources) -> the one running service. With
several running and none of these flags the command refuses and lists them: acting on an arbitrary
one (``ray.init(address="auto")``) is how an operator ends up scaling the wrong service.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cli.service_record import (
    ServiceRecord,
    load_records,
    records_dir,
    remove_record,
    stale_reason,
)
from settings import environment

DEFAULT_APP = "pdserve"


@dataclass(frozen=True)
class Target:
    ray_address: str
    app_name: str
    record: ServiceRecord | None = None

    def describe(self) -> str:
        if self.record is None:
            return f"Ray cluster {self.ray_address}, application {self.app_name!r} (no pdserve record)"
        app = "" if self.app_name == self.record.app_name else f", application {self.app_name!r}"
        return self.record.describe() + app


def add_target_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("which service (needed when several run)")
    g.add_argument("--service", metavar="NAME", help="the service's name (pdserve serve --name)")
    g.add_argument(
        "--endpoint", metavar="URL", help="the service serving HTTP here, e.g. http://127.0.0.1:8000"
    )
    g.add_argument("--address", metavar="HOST:PORT", help="its Ray cluster (GCS address)")
    g.add_argument(
        "--app", default=None, help=f"Serve application name (default: the record's, or {DEFAULT_APP})"
    )


def choose_target(
    args: argparse.Namespace, directory: Path | None = None, warn: Callable[[str], None] | None = None
) -> Target:
    """The service the flags name; ValueError with what to do when they name none or are ambiguous."""
    directory = directory or records_dir()
    warn = warn or (lambda msg: print(msg, file=sys.stderr))
    records = load_records(directory)
    if args.service:
        record = _named(records, args.service, directory)
    elif args.endpoint:
        record = _one_live([r for r in records if _same_endpoint(r.endpoint, args.endpoint)], directory, warn)
        if record is None:
            raise ValueError(f"no running pdserve service serves {args.endpoint}{_listing(directory, warn)}")
    elif args.address:
        record = _one_live(
            [r for r in records if _same_address(r.ray_address, args.address)], directory, warn
        )
        if record is None:  # a cluster started some other way: Ray's own token sources apply
            return Target(args.address, args.app or DEFAULT_APP)
    else:
        live = _live(records, directory, warn)
        if not live:
            raise ValueError(
                f"no running pdserve service found (records in {directory}); start one with "
                "`pdserve serve`, or give --address HOST:PORT of its Ray cluster"
            )
        if len(live) > 1:
            raise ValueError(
                f"{len(live)} pdserve services are running; choose one with --service NAME "
                "(or --endpoint URL / --address HOST:PORT):\n" + "\n".join(f"  {r.describe()}" for r in live)
            )
        record = live[0]
    return Target(record.ray_address, args.app or record.app_name, record)


def _named(records: list[ServiceRecord], name: str, directory: Path) -> ServiceRecord:
    record = next((r for r in records if r.name == name), None)
    if record is None:
        running = ", ".join(r.name for r in records) or "none"
        raise ValueError(f"no pdserve service named {name!r} (recorded services: {running})")
    reason = stale_reason(record)
    if reason is not None:
        remove_record(record.name, directory, pid=record.pid)
        raise ValueError(
            f"service {name!r} is not running: {reason} (it did not shut down cleanly); "
            "its stale record was removed"
        )
    return record


def _live(records: list[ServiceRecord], directory: Path, warn: Callable[[str], None]) -> list[ServiceRecord]:
    live = []
    for record in records:
        reason = stale_reason(record)
        if reason is None:
            live.append(record)
        else:
            remove_record(record.name, directory, pid=record.pid)
            warn(f"note: removed the stale record of service {record.name!r}: {reason}")
    return live


def _one_live(records, directory, warn) -> ServiceRecord | None:
    live = _live(records, directory, warn)
    if len(live) > 1:
        raise ValueError(
            "several services match; choose one with --service NAME:\n"
            + "\n".join(f"  {r.describe()}" for r in live)
        )
    return live[0] if live else None


def _listing(directory: Path, warn) -> str:
    live = _live(load_records(directory), directory, warn)
    return "".join(f"\n  running: {r.describe()}" for r in live) or " (no pdserve service is running)"


def _norm_endpoint(url: str) -> str:
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    if "://" not in url:
        url = "http://" + url
    scheme, rest = url.split("://", 1)
    host, _, port = rest.rpartition(":")
    if environment.is_loopback(host) or host == "0.0.0.0":  # the same server, asked by its local name
        host = "127.0.0.1"
    return f"{scheme}://{host}:{port}" if host else f"{scheme}://{rest}"


def _same_endpoint(recorded: str, given: str) -> bool:
    return _norm_endpoint(recorded) == _norm_endpoint(given)


def _same_address(recorded: str, given: str) -> bool:
    """Equal, or the same port of this machine asked by its loopback name."""
    if recorded == given:
        return True
    host, _, port = given.rpartition(":")
    return environment.is_loopback(host) and recorded.rpartition(":")[2] == port
