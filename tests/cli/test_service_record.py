"""The per-service record ``pdserve serve`` leaves for ``status`` / ``scale``: private (it holds the
Ray token), found again, removed by its owner only, and recognised as stale once its ``serve``
process or its Ray cluster is gone."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys

import pytest

from cli.service_record import (
    ServiceRecord,
    claim_name,
    load_records,
    new_record,
    read_record,
    record_path,
    records_dir,
    remove_record,
    stale_reason,
    write_record,
)

TOKEN = "0123456789abcdef-secret-token"


@pytest.fixture
def listening():
    """A local port something answers on (stands in for a live GCS)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield f"127.0.0.1:{s.getsockname()[1]}"


def closed_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_record_is_private_found_again_and_never_shows_its_token(tmp_path, listening):
    record = new_record("svc", "pdserve", "http://127.0.0.1:8000", listening, TOKEN)
    path = write_record(record, tmp_path / "services")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert read_record(path) == record and read_record(path).auth_token == TOKEN
    assert load_records(tmp_path / "services") == [record]
    assert TOKEN not in repr(record) and TOKEN not in record.describe()
    assert "svc" in record.describe() and listening in record.describe()


def test_records_live_in_the_users_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert records_dir() == tmp_path / "home" / ".cache" / "pdserve" / "services"


def test_names_that_would_escape_the_directory_are_refused(tmp_path):
    for bad in ("../x", "a/b", ".hidden", ""):
        with pytest.raises(ValueError, match="invalid service name"):
            record_path(bad, tmp_path)


def test_a_record_is_removed_only_by_the_process_that_wrote_it(tmp_path, listening):
    record = new_record("svc", "pdserve", "http://127.0.0.1:8000", listening, None)
    write_record(record, tmp_path)
    remove_record("svc", tmp_path, pid=record.pid + 1)  # an older serve of that name, shutting down
    assert load_records(tmp_path) == [record]
    remove_record("svc", tmp_path, pid=record.pid)
    assert load_records(tmp_path) == []
    remove_record("svc", tmp_path, pid=record.pid)  # already gone: fine


def test_unreadable_files_are_skipped(tmp_path, listening):
    write_record(new_record("good", "pdserve", "http://127.0.0.1:1", listening, None), tmp_path)
    (tmp_path / "half.json").write_text('{"name": "half"')
    (tmp_path / "other.json").write_text('{"something": 1}')
    assert [r.name for r in load_records(tmp_path)] == ["good"]


def test_stale_when_the_serve_process_or_the_cluster_is_gone(listening):
    live = new_record("svc", "pdserve", "http://127.0.0.1:8000", listening, None)
    assert stale_reason(live) is None
    gone = ServiceRecord("svc", "pdserve", "http://127.0.0.1:8000", listening, pid=dead_pid())
    assert "process" in stale_reason(gone) and str(gone.pid) in stale_reason(gone)
    reused = ServiceRecord(
        "svc", "pdserve", "http://x:1", listening, pid=os.getpid(), pid_start="1"
    )  # this pid, but not the process that wrote the record
    assert "process" in stale_reason(reused)
    no_cluster = new_record("svc", "pdserve", "http://127.0.0.1:8000", closed_address(), None)
    assert "does not answer" in stale_reason(no_cluster)


def test_a_name_is_refused_while_a_live_service_holds_it_and_freed_when_stale(tmp_path, listening):
    write_record(new_record("svc", "pdserve", "http://127.0.0.1:8000", listening, None), tmp_path)
    with pytest.raises(ValueError, match="'svc' is already running"):
        claim_name("svc", tmp_path)
    write_record(ServiceRecord("svc", "pdserve", "http://x:1", listening, pid=dead_pid()), tmp_path)
    assert claim_name("svc", tmp_path) == "svc"
    assert claim_name("other", tmp_path) == "other"
