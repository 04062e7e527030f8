"""Which service ``pdserve status`` / ``scale`` act on: the only one running, or the one the flags
name; with several running and no flag, a refusal that lists them (never an arbitrary pick); a
stale record is reported and removed; a connection failure is one line, never a traceback."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys

import pytest

from cli.main import main
from cli.service_record import ServiceRecord, load_records, new_record, write_record
from cli.service_target import Target, choose_target

TOKEN = "a-secret-ray-token-value"


@pytest.fixture
def gcs():
    """Two local ports something answers on: stand-ins for two services' GCS."""
    socks = [socket.socket(), socket.socket()]
    for s in socks:
        s.bind(("127.0.0.1", 0))
        s.listen()
    yield [f"127.0.0.1:{s.getsockname()[1]}" for s in socks]
    for s in socks:
        s.close()


def args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"service": None, "endpoint": None, "address": None, "app": None, **kw})


def live(tmp_path, name: str, port: int, address: str, token: str | None = TOKEN) -> ServiceRecord:
    record = new_record(name, "pdserve", f"http://127.0.0.1:{port}", address, token)
    write_record(record, tmp_path)
    return record


def dead(tmp_path, name: str, address: str) -> ServiceRecord:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    record = ServiceRecord(name, "pdserve", "http://127.0.0.1:9", address, pid=p.pid)
    write_record(record, tmp_path)
    return record


def test_the_only_running_service_is_chosen_with_its_token(tmp_path, gcs):
    a = live(tmp_path, "a", 8000, gcs[0])
    target = choose_target(args(), tmp_path)
    assert target == Target(gcs[0], "pdserve", a) and target.record.auth_token == TOKEN
    assert "'a'" in target.describe() and gcs[0] in target.describe() and TOKEN not in target.describe()


def test_several_running_services_need_a_choice(tmp_path, gcs):
    a, b = live(tmp_path, "a", 8000, gcs[0]), live(tmp_path, "b", 8001, gcs[1])
    with pytest.raises(ValueError, match="2 pdserve services are running; choose one with --service") as err:
        choose_target(args(), tmp_path)
    assert "'a'" in str(err.value) and "'b'" in str(err.value) and TOKEN not in str(err.value)
    assert choose_target(args(service="b"), tmp_path).record == b
    assert choose_target(args(endpoint="http://localhost:8000/v1/"), tmp_path).record == a
    assert choose_target(args(endpoint="127.0.0.1:8001"), tmp_path).record == b
    assert choose_target(args(address=gcs[1]), tmp_path).record == b
    assert choose_target(args(service="a", app="other"), tmp_path).app_name == "other"


def test_unknown_names_and_endpoints_are_refused_clearly(tmp_path, gcs):
    live(tmp_path, "a", 8000, gcs[0])
    with pytest.raises(ValueError, match=r"no pdserve service named 'x' \(recorded services: a\)"):
        choose_target(args(service="x"), tmp_path)
    with pytest.raises(ValueError, match=r"no running pdserve service serves http://127\.0\.0\.1:9999"):
        choose_target(args(endpoint="http://127.0.0.1:9999"), tmp_path)
    with pytest.raises(ValueError, match="no running pdserve service found"):
        choose_target(args(), tmp_path / "empty")


def test_an_address_without_a_record_is_taken_as_given(tmp_path, gcs):
    target = choose_target(args(address="10.0.0.5:6379"), tmp_path)
    assert target == Target("10.0.0.5:6379", "pdserve", None)
    assert "no pdserve record" in target.describe()


def test_stale_records_are_reported_and_removed(tmp_path, gcs):
    a = live(tmp_path, "a", 8000, gcs[0])
    dead(tmp_path, "gone", gcs[1])
    notes: list[str] = []
    assert choose_target(args(), tmp_path, warn=notes.append).record == a  # not "2 services running"
    assert len(notes) == 1 and "stale record of service 'gone'" in notes[0] and "is gone" in notes[0]
    assert [r.name for r in load_records(tmp_path)] == ["a"]
    dead(tmp_path, "gone", gcs[1])
    with pytest.raises(ValueError, match="service 'gone' is not running: its pdserve serve process"):
        choose_target(args(service="gone"), tmp_path)
    assert [r.name for r in load_records(tmp_path)] == ["a"]


@pytest.mark.parametrize("command", ["status", "scale"])
def test_the_command_line_errors_are_one_line(tmp_path, gcs, monkeypatch, capsys, command):
    monkeypatch.setenv("HOME", str(tmp_path))
    extra = ["--prefill", "2"] if command == "scale" else []
    directory = tmp_path / ".cache" / "pdserve" / "services"
    live(directory, "a", 8000, gcs[0])
    live(directory, "b", 8001, gcs[1])

    def no_connection(target):
        pytest.fail(f"connected to {target.describe()} although two services run")

    with monkeypatch.context() as m:
        m.setattr("cli.ray_cluster.connect", no_connection)
        assert main([command, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: 2 pdserve services are running; choose one with --service NAME")
    assert "Traceback" not in err and TOKEN not in err

    with socket.socket() as s:  # a cluster address nothing answers on: one line, exit status 1
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    assert main([command, *extra, "--address", closed]) == 1
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [
        f"error: cannot reach Ray cluster {closed}, application 'pdserve' (no pdserve record): "
        f"nothing answers at {closed}"
    ]


@pytest.mark.parametrize("command", ["status", "scale"])
def test_an_address_that_is_no_ray_cluster_is_one_line_not_a_wait(tmp_path, monkeypatch, capsys, command):
    """The service's HTTP port given as --address (the banner prints it): ray.init waited minutes on
    it without a word; a gRPC server that is not Ray's is told apart too."""
    import http.server
    import threading
    from concurrent import futures

    import grpc

    monkeypatch.setenv("HOME", str(tmp_path))
    extra = ["--prefill", "2"] if command == "scale" else []
    http_server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=http_server.serve_forever, daemon=True).start()
    grpc_server = grpc.server(futures.ThreadPoolExecutor(1))
    grpc_port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    try:
        for address, why in (
            (f"127.0.0.1:{http_server.server_address[1]}", "it does not answer gRPC: an HTTP port?"),
            (f"127.0.0.1:{grpc_port}", "a gRPC server, not Ray's"),
        ):
            assert main([command, *extra, "--address", address]) == 1
            (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
            assert line.startswith(f"error: {address} is not a Ray cluster's address ({why}): ")
    finally:
        http_server.shutdown()
        grpc_server.stop(0)


def test_an_endpoint_or_address_asked_by_any_loopback_name_is_the_recorded_one():
    from cli.service_target import _same_address, _same_endpoint
    from settings.environment import is_loopback

    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.1.1", "localhost", "::1", "[::1]"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "", "192.0.2.2", "[::]"))
    assert _same_endpoint("http://127.0.0.1:8000", "http://[::1]:8000/v1")
    assert _same_address("127.0.0.1:6380", "[::1]:6380") and not _same_address("127.0.0.1:6380", "[::1]:6381")
