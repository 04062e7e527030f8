"""``bench.speed_probe``: the validation's measure of how fast the machine runs now. Its work is the
same every time (fresh prompts, never a prefix hit), it leaves nothing in its engine, and the
caller's torch threads are as they were."""

from __future__ import annotations

import torch

from bench.speed_probe import DECODE_BATCH, RUNS, SpeedProbe


def test_the_probe_times_the_same_fresh_work_and_leaves_nothing_behind(tiny_llama):
    threads = torch.get_num_threads()
    probe = SpeedProbe(str(tiny_llama))
    seconds = [probe.seconds() for _ in range(2)]
    assert all(s > 0 for s in seconds)
    stats = probe.core.stats()
    assert stats.prefix_cache_hits == 0  # fresh prompts: the work is not shortened by the cache
    assert probe.n == 2 * RUNS * (2 + DECODE_BATCH)
    assert not probe.core.has_work() and stats.num_free_blocks == stats.num_blocks
    assert torch.get_num_threads() == threads
    result, mean = probe.around(lambda: "measured")
    assert result == "measured" and mean > 0
