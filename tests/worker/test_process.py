"""A worker process's ``--kv-transfer`` flag: NIXL by default; ``inprocess`` builds the in-process
backend without importing NIXL (aggregated serving on hosts without it); a prefill worker, whose KV
is read by other processes, refuses ``inprocess`` at start."""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap

from worker.process import add_worker_args, transfer_factory_from_args
from worker.runtime import nixl_transfer


def test_nixl_is_the_default():
    p = argparse.ArgumentParser()
    add_worker_args(p, "decode")
    assert transfer_factory_from_args(p.parse_args([])) is nixl_transfer


def test_an_inprocess_decode_worker_never_imports_nixl(tmp_path):
    script = textwrap.dedent(
        f"""
        import argparse, sys
        from decode_worker.worker import DecodeWorker, DecodeWorkerConfig
        from engine.args import add_engine_args, engine_config_from_args
        from engine.models.zero_cost import create_zero_cost_model
        from worker.process import add_worker_args, transfer_factory_from_args

        model = create_zero_cost_model({str(tmp_path / "zc")!r})
        p = argparse.ArgumentParser()
        add_engine_args(p)
        add_worker_args(p, "decode")
        args = p.parse_args(["--model", str(model), "--num-blocks", "16", "--kv-transfer", "inprocess"])
        config = DecodeWorkerConfig(engine_config_from_args(args), worker_id="d", redis_url=None)
        worker = DecodeWorker(config, transfer_factory=transfer_factory_from_args(args))
        print(type(worker.transfer).__name__, sorted(m for m in sys.modules if "nixl" in m))
        worker.stop()
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "InProcessBackend []"


def test_a_prefill_worker_refuses_inprocess_transfer():
    cmd = [sys.executable, "-m", "prefill_worker", "--model", "unused", "--kv-transfer", "inprocess"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--kv-transfer inprocess cannot hand KV to decode workers in other processes" in done.stderr
