"""bench.kv_tiers in its quick form: both workloads, every configuration, same tokens, blocks back."""

from __future__ import annotations

import json

from bench import kv_tiers


def test_quick_run_compares_tiers_on_an_overflowing_and_a_fitting_workload(tiny_llama, tmp_path, capsys):
    out = tmp_path / "kv_tiers.json"
    assert kv_tiers.main(["--quick", "--model", str(tiny_llama), "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    over, fit = result["workloads"]["overflowing"], result["workloads"]["fitting"]
    assert over["working_set_over_pool"] > 1 > fit["working_set_over_pool"]
    for w in (over, fit):
        assert w["identical_outputs"]
        assert all(r["blocks_free_after"] and r["requests"] > 0 for r in w["runs"].values())
        assert w["runs"]["no_tier"]["host_hit_tokens"] == 0
    assert set(over["runs"]) == {
        "no_tier",
        "host_tier",
        "small_host",
        "small_host_disk",
        "small_host_disk_sync",
    }
    # The disk tier's blocks read ahead of admission, and in the peer run inside the admitting steps.
    ahead, sync = over["runs"]["small_host_disk"], over["runs"]["small_host_disk_sync"]
    assert ahead["read_ahead_blocks"] > 0 == sync["read_ahead_blocks"]
    assert sync["disk_hit_tokens"] > 0 and sync["disk_read_engine_ms"] > 0
    assert set(fit["runs"]) == {"no_tier", "host_tier", "small_host_disk"}
    # Overflowing: the second round's prefixes were evicted; only the tier serves them.
    assert over["runs"]["host_tier"]["host_hit_tokens"] > 0
    assert over["runs"]["host_tier"]["prefix_hit_tokens"] > over["runs"]["no_tier"]["prefix_hit_tokens"]
    # A host tier too small for them: the disk tier under it serves what the host tier dropped.
    small, disk = over["runs"]["small_host"], over["runs"]["small_host_disk"]
    assert small["disk_hit_tokens"] == 0 < disk["disk_hit_tokens"]
    assert disk["prefix_hit_tokens"] > small["prefix_hit_tokens"]
    # Fitting: nothing is evicted, so no tier is ever touched.
    assert fit["runs"]["host_tier"]["host_offloaded_blocks"] == 0
    assert fit["runs"]["small_host_disk"]["disk_written_blocks"] == 0
    assert (tmp_path / "kv_tiers.png").exists()
    assert "identical outputs: yes" in capsys.readouterr().out
