"""``bench.call_stream_transport``: a short run over both transports delivers every token of every
call and reports each end's CPU per step."""

from __future__ import annotations

import json

from bench import call_stream_transport


def test_a_short_run_delivers_every_token_over_both_transports(tmp_path, capsys):
    out = tmp_path / "transport.json"
    argv = ["--messages", "40", "--calls", "4", "--step-us", "500", "--output", str(out)]
    result = call_stream_transport.main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    for transport in ("grpc", "socket"):
        r = result["transports"][transport]
        assert r["steps"] == 40 and r["tokens"] == 40 * 4, (transport, r)
        assert r["sender_cpu_us_per_step"] > 0 and r["receiver_cpu_us_per_step"] > 0
    assert result["grpc_over_socket_cpu"] > 0
    assert "gRPC / socket, CPU per step at both ends" in capsys.readouterr().out
