"""An engine built off-thread leaves no OpenMP team behind on the building thread, so the engine
loop's thread can be the process's only one (``engine.cpu_threads``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from engine.cpu_threads import build_off_thread

# In a fresh process (pytest's own threads may already own teams): build an engine with 2 torch
# threads, wait until the process is back to its thread count from before the build (the finished
# build thread's team winds down on its own), then run one parallel op on the main thread, which
# must start a team there (one more thread): the check sees teams. Built on the main thread (the
# control), the team is there at once and stays.
_PROBE = textwrap.dedent(
    """
    import os, sys, time
    import torch
    from engine import EngineConfig, EngineCore
    from engine.cpu_threads import build_off_thread

    def threads():
        return len(os.listdir("/proc/self/task"))

    torch.set_num_threads(2)
    config = EngineConfig(model=sys.argv[1], num_blocks=64, cpu_threads=2)
    before = threads()
    if sys.argv[2] == "off":
        core = build_off_thread(lambda: EngineCore(config))
        deadline = time.monotonic() + 30
        while threads() != before and time.monotonic() < deadline:
            time.sleep(0.01)
    else:
        core = EngineCore(config)
    settled = threads()
    x = torch.randn(256, 4096)
    y = x * x
    print(before, settled, threads())
    """
)


def _probe(model_dir, mode: str) -> tuple[int, int, int]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(model_dir), mode], capture_output=True, text=True, check=True
    )
    before, settled, after_op = map(int, out.stdout.split()[-3:])
    return before, settled, after_op


def test_an_engine_built_off_thread_leaves_the_builder_without_a_thread_team(tiny_llama):
    before, settled, after_op = _probe(tiny_llama, "off")
    assert settled == before, "the build left threads behind"
    assert after_op == settled + 1, "a parallel op on the main thread started its team"
    # The control: built on the main thread, the team stays (the op reuses it).
    before, settled, after_op = _probe(tiny_llama, "on")
    assert settled == before + 1 and after_op == settled


def test_build_off_thread_returns_the_value_and_raises_the_error():
    assert build_off_thread(lambda: 41 + 1) == 42

    def fail():
        raise ValueError("bad model")

    with pytest.raises(ValueError, match="bad model"):
        build_off_thread(fail)


class _Built(Exception):
    """Raised where a CUDA engine would pick its attention kernels: after the thread policy."""


@pytest.mark.parametrize(
    ("device", "configured", "expected"),
    [("cuda", None, 1), ("cuda:1", 3, 3), ("cpu", None, 2), ("cpu", 1, 1)],
)
def test_a_gpu_engine_runs_one_intra_op_thread_unless_told(
    tiny_llama, monkeypatch, device, configured, expected
):
    """On a GPU host torch's default pool (one thread per core) only spins on the engine's small host
    ops: a CUDA-configured engine sets the process to 1 thread; a CPU engine keeps torch's own count."""
    import torch

    from engine import EngineConfig, engine_core

    def stop(*args, **kwargs):
        raise _Built

    monkeypatch.setattr(engine_core, "usable_device", torch.device)  # as if this host had the GPUs
    monkeypatch.setattr(engine_core, "get_attention_backend", stop)  # no CUDA here: stop the build
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(_Built):
            engine_core.EngineCore(EngineConfig(model=str(tiny_llama), device=device, cpu_threads=configured))
        assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(before)
