"""bench.kv_disk_writes at a small size: both ways timed for every size and spacing, every block read
back from the file after its writes landed."""

from __future__ import annotations

import json

from bench import kv_disk_writes


def test_a_small_run_times_both_ways_for_every_size(tmp_path, capsys):
    out = tmp_path / "writes.json"
    kv_disk_writes.main(["--blocks", "4", "--repeats", "1", "--dir", str(tmp_path), "--output", str(out)])
    result = json.loads(out.read_text())
    assert set(result["sizes"]) == {f"{s}, {g} ms apart" for s in kv_disk_writes.SIZES for g in (0, 2)}
    for row in result["sizes"].values():
        for way in ("synchronous", "queued"):
            assert row[way]["engine_thread_us_per_block_mean"] > 0 and row[way]["all_landed_s"] > 0
        assert row["engine_thread_ratio"] > 0
    assert "queued" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["writes.json"]  # the tier's files are gone
