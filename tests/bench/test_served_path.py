"""The served-path benchmark runs every layout from standalone processes (engine alone, fed in
cohorts and staggered, minimal server, decode worker + router + ingress, the same with the engine in
its own process) and reports each one's rate and each process's CPU per streamed token, with every
request's tokens delivered and every KV block given back."""

from __future__ import annotations

import json

import pytest

from bench import served_path
from engine.models.zero_cost import create_zero_cost_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_a_tiny_run_reports_every_layout_and_process(tmp_path, capsys):
    model = create_zero_cost_model(tmp_path / "zero-cost")
    out = tmp_path / "served_path.json"
    argv = [
        "--model",
        str(model),
        "--workloads",
        "8/8",
        # Enough tokens that every process's CPU spans several of /proc's 10 ms ticks (8 requests
        # once read 0 ticks for the minimal server, whose CPU the ratios divide by).
        "--num-requests",
        "96",
        "--concurrency",
        "8",
        "--ttft-requests",
        "3",
    ]
    served_path.main([*argv, "--warmup", "2", "--no-disagg", "--output", str(out)])

    result = json.loads(out.read_text())
    layouts = result["workloads"]["8/8"]
    assert list(layouts) == ["engine", "engine_staggered", "minimal", "stack", "split", "split_rh"]
    for name, run in layouts.items():
        assert run["requests_per_s"] > 0, name
        assert run["complete"], name
        assert run["streamed_tokens"] == 96 * 8, name
        # /proc counts CPU in 10 ms ticks: on 64 tokens a light process (the split worker's
        # gRPC side) may read zero, but the layout as a whole cannot.
        assert all(cpu >= 0 for cpu in run["cpu_ms_per_token"].values()), name
        assert sum(run["cpu_ms_per_token"].values()) > 0, name
        assert run["ttft_c1_p50_ms"] > 0, name  # one request at a time
    stack = layouts["stack"]
    assert set(stack["cpu_ms_per_token"]) == {"decode_worker", "router", "ingress"}
    assert stack["stack_cpu_ms_per_token"] == pytest.approx(sum(stack["cpu_ms_per_token"].values()))
    assert stack["load"]["completed"] == 96 and stack["load"]["failed"] == 0
    # The load generator's own CPU, in 10 ms ticks too: 64 tokens of a fast run may read zero.
    assert stack["load_generator_cpu_ms_per_token"] >= 0
    blocks = stack["kv_blocks"]["decode_worker"]
    assert blocks["free_after"] == blocks["free_before"] > 0
    split = layouts["split"]  # the decode worker's engine in its own process, measured apart
    assert set(split["cpu_ms_per_token"]) == {"decode_worker", "engine_process", "router", "ingress"}
    assert (
        split["kv_blocks"]["decode_worker"]["free_after"]
        == split["kv_blocks"]["decode_worker"]["free_before"]
    )
    # The router inside the HTTP process (as pdserve serve runs it): no router process.
    assert set(layouts["split_rh"]["cpu_ms_per_token"]) == {"decode_worker", "engine_process", "ingress"}
    # Each process's threads besides its main one: a part of its CPU (within a 10 ms tick of it).
    tick = 10.0 / (96 * 8)
    for name in ("stack", "split", "split_rh"):
        cpu, background = layouts[name]["cpu_ms_per_token"], layouts[name]["background_cpu_ms_per_token"]
        assert set(background) == set(cpu), name
        assert all(0 <= background[p] <= cpu[p] + tick for p in cpu), (name, background, cpu)
        # The HTTP work is the ingress's main thread's (several ticks), not its background's.
        assert background["ingress"] < cpu["ingress"], (name, background, cpu)
    assert layouts["split_rh"]["load"]["completed"] == 96 and layouts["split_rh"]["load"]["failed"] == 0
    assert set(layouts["minimal"]["cpu_ms_per_token"]) == {"minimal_server"}
    assert layouts["minimal"]["cpu_over_minimal"] == pytest.approx(1.0)
    assert layouts["engine"]["over_engine"] == pytest.approx(1.0)
    assert set(layouts["engine_staggered"]["cpu_ms_per_token"]) == {"engine"}
    assert result["args"]["num_requests"] == 96
    report = capsys.readouterr().out
    assert "== 8/8 tokens in/out" in report and "KV BLOCKS NOT RETURNED" not in report


def test_a_minimal_server_cpu_under_one_clock_tick_gives_no_ratio():
    """A short run can end inside one 10 ms tick of the minimal server's CPU: its ratio is left out,
    not a division by zero (seen once the served path got faster)."""
    layouts = {
        "minimal": {"requests_per_s": 100.0, "cpu_ms_per_token": {"minimal_server": 0.0}},
        "stack": {"requests_per_s": 50.0, "cpu_ms_per_token": {"ingress": 0.1, "router": 0.05}},
    }
    served_path.add_ratios(layouts)
    assert layouts["stack"]["cpu_over_minimal"] is None
    assert layouts["stack"]["stack_cpu_ms_per_token"] == pytest.approx(0.15)
