"""The multi-LoRA benchmark runs end to end on a small workload: every configuration is measured, the
ratios are against the base model of the same run, the swapping configuration swaps, and the JSON
and the plot are written."""

from __future__ import annotations

import json

from bench.lora_throughput import CONFIGS, main


def test_the_benchmark_measures_every_configuration(tmp_path):
    out = tmp_path / "lora.json"
    argv = [
        "--requests",
        "8",
        "--prompt-len",
        "8",
        "--output-len",
        "4",
        "--rounds",
        "1",
        "--output",
        str(out),
    ]
    assert main(argv) == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == list(CONFIGS)
    assert rows["base"]["vs_base"] == 1.0 and all(r["tokens_per_s"] > 0 for r in rows.values())
    assert "swaps" not in rows["base"]
    assert rows["8 adapters"]["swaps"] >= 4  # the adapters the warm-up did not load
    assert rows["8 adapters, 2 slots"]["swaps"] >= 8  # two slots for eight adapters: each comes in
    assert out.with_suffix(".png").stat().st_size > 0
