"""The host-overhead benchmark runs the real engine step around the zero-cost model and reports
each shape's step time and its parts; its JSON holds a row per shape."""

from __future__ import annotations

import json

from bench import host_overhead, host_overhead_revisions


def test_a_tiny_grid_reports_positive_times_per_shape(tmp_path, capsys):
    out = tmp_path / "host.json"
    host_overhead.main(
        ["--batches", "2", "--contexts", "32,48", "--steps", "4", "--profile", "2", "--json", str(out)]
    )
    result = json.loads(out.read_text())
    rows = result["current"]["rows"]
    assert [(r["batch"], r["context"]) for r in rows] == [(2, 32), (2, 48)]
    for r in rows:
        assert r["steps"] == 4
        assert all(r[k] > 0 for k in ("mean_ms", "p50_ms", "schedule_ms", "execute_ms", "update_ms"))
        # The parts are timed inside the step; the slack is float rounding of perf_counter differences.
        assert r["schedule_ms"] + r["execute_ms"] + r["update_ms"] <= r["mean_ms"] + 1e-6
        assert r["profile_top"] and r["profile_top"][0]["own_ms_per_step"] > 0
    assert result["current"]["mode"] == "zero-cost checkpoint"
    report = capsys.readouterr().out
    assert "48 / 32 context" in report


def test_a_swapped_model_on_a_tiny_checkpoint_measures_too(tmp_path):
    """The path a revision without the zero-cost model takes (--baseline-ref)."""
    out = tmp_path / "host.json"
    host_overhead.main(
        ["--batches", "2", "--contexts", "32", "--steps", "4", "--force-swap", "--json", str(out)]
    )
    result = json.loads(out.read_text())
    assert result["current"]["mode"].startswith("tiny checkpoint")
    assert result["current"]["rows"][0]["mean_ms"] > 0


def test_steps_as_the_engine_process_runs_them_overlapped(tmp_path):
    """``--engine-process``: each step's outputs encoded for the channel (every token accounted
    for, or the bench fails); ``--overlap`` reaches both sides of a comparison."""
    out = tmp_path / "host.json"
    args = ["--batches", "3", "--contexts", "32", "--steps", "4", "--overlap", "--engine-process"]
    host_overhead.main([*args, "--json", str(out)])
    current = json.loads(out.read_text())["current"]
    assert current["async_scheduling"] is True and current["engine_process"] is True
    assert current["rows"][0]["mean_ms"] > 0
    argv = host_overhead_revisions.worker_argv(host_overhead.parse_args(args), out)
    assert "--overlap" in argv and "--engine-process" in argv


def test_stored_runs_plot_per_batch(tmp_path):
    """``python -m bench.host_overhead_report --plot``: a PNG of the stored runs' minima."""
    from bench import host_overhead_report

    def rows(scale):
        return [
            {"batch": b, "context": c, "mean_ms": scale * b * (1 + i), "p50_ms": scale * b}
            for b in (1, 256)
            for i, c in enumerate((128, 4096))
        ]

    runs = [{"current": {"rows": rows(0.001 * k)}, "baseline": {"rows": rows(0.004)}} for k in (1, 2)]
    stored = tmp_path / "runs.json"
    stored.write_text(json.dumps({"command": "test", "runs": runs}))
    out = tmp_path / "plot.png"
    host_overhead_report.main([str(stored), "--plot", str(out), "--labels", "old,new"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_a_churning_batch_is_timed_with_and_without_the_steady_paths(capsys, tmp_path):
    """``bench.host_overhead_churn``: both sides run (each in a process of its own, with this
    call's shape) and compare; ``--json`` keeps the runs."""
    from bench import host_overhead_churn

    out_json = tmp_path / "churn.json"
    host_overhead_churn.main(
        [
            "--batch",
            "4",
            "--context",
            "32",
            "--steps",
            "24",
            "--every",
            "2",
            "--runs",
            "1",
            "--json",
            str(out_json),
        ]
    )
    out = capsys.readouterr().out
    assert "steady paths on : mean" in out and "steady paths off: mean" in out
    assert "batch 4 x 32, one ends every 2 steps" in out and "x)" in out
    result = json.loads(out_json.read_text())
    assert (result["batch"], result["every"], len(result["runs"]["on"]), len(result["runs"]["off"])) == (
        4,
        2,
        1,
        1,
    )
    assert result["on_over_off"] == result["min_mean_ms"]["on"] / result["min_mean_ms"]["off"]


def test_rounds_report_each_figure_as_the_median_over_them(tmp_path, monkeypatch):
    """``--rounds``: every shape measured once per round, the order turned round each time (a
    drifting machine tilts no shape), each figure the median of the rounds', their means kept."""
    calls, means = [], iter([1.0, 2.0, 9.0, 8.0, 3.0, 4.0])  # (2,32) gets 1, 8, 3; (2,48) 2, 9, 4

    def fake(checkpoint, swap, batch, context, steps, *args, **kwargs):
        calls.append(context)
        m = next(means)
        parts = dict.fromkeys(("p90_ms", "schedule_ms", "execute_ms", "update_ms", "other_ms"), m / 4)
        row = {"batch": batch, "context": context, "steps": steps, "mean_ms": m, "p50_ms": m / 2, **parts}
        return row | {"by_slot_p50_ms": {0: m, 15: 2 * m}}

    monkeypatch.setattr(host_overhead, "measure", fake)
    out = tmp_path / "host.json"
    host_overhead.main(["--batches", "2", "--contexts", "32,48", "--rounds", "3", "--json", str(out)])
    assert calls == [32, 48, 48, 32, 32, 48]
    a, b = json.loads(out.read_text())["current"]["rows"]
    assert (a["context"], a["round_mean_ms"], a["mean_ms"], a["p50_ms"]) == (32, [1.0, 8.0, 3.0], 3.0, 1.5)
    assert (b["context"], b["round_mean_ms"], b["mean_ms"]) == (48, [2.0, 9.0, 4.0], 4.0)
    assert a["by_slot_p50_ms"] == {"0": 3.0, "15": 6.0}
    argv = host_overhead_revisions.worker_argv(host_overhead.parse_args(["--rounds", "3"]), out)
    assert argv[argv.index("--rounds") + 1] == "3"
