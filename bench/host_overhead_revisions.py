"""``python -m bench.host_overhead --baseline-ref REV``: the same grid on another revision of the
engine, each side in a process of its own (``bench/host_overhead.py --worker`` with that side's tree
first on ``PYTHONPATH``), so new / old compares like with like."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOST_OVERHEAD = Path(__file__).resolve().with_name("host_overhead.py")


def worker_argv(args, out: Path) -> list[str]:
    """``bench/host_overhead.py`` as one side of a comparison: the grid of ``args`` to ``out``."""
    argv = [sys.executable, str(HOST_OVERHEAD), "--worker", "--json", str(out)]
    argv += ["--batches", ",".join(map(str, args.batches)), "--contexts", ",".join(map(str, args.contexts))]
    for name in ("threads", "steps", "token_budget", "profile", "attention_backend", "rounds"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    flags = [
        f"--{name.replace('_', '-')}"
        for name in ("force_swap", "overlap", "engine_process")
        if getattr(args, name)
    ]
    return argv + flags


def run_in_subprocess(args, tree: Path, out: Path) -> dict:
    """The grid on the ``engine`` package of ``tree``, in a fresh process."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]))
    subprocess.run(worker_argv(args, out), env=env, cwd=tree, check=True)
    result = json.loads(out.read_text())
    if Path(result["engine"]) != tree.resolve():
        raise RuntimeError(f"the worker imported the engine of {result['engine']}, not of {tree}")
    return result


def run_against(args) -> dict:
    """This tree and ``args.baseline_ref``, each in its own process (the same conditions)."""
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{args.baseline_ref}^{{commit}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = Path(tmp) / "baseline"
        old_tree.mkdir()
        archive = subprocess.Popen(["git", "-C", str(ROOT), "archive", commit], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", str(old_tree)], stdin=archive.stdout, check=True)
        archive.stdout.close()
        if archive.wait() != 0:
            raise RuntimeError(f"git archive {commit} failed")
        print(f"baseline: {args.baseline_ref} ({commit[:12]})", file=sys.stderr, flush=True)
        baseline = run_in_subprocess(args, old_tree, Path(tmp) / "baseline.json")
        print("current: the working tree", file=sys.stderr, flush=True)
        current = run_in_subprocess(args, ROOT, Path(tmp) / "current.json")
    baseline.update(ref=args.baseline_ref, commit=commit, engine="(archive)")
    return {"current": current, "baseline": baseline}
