"""``pdserve manifests`` from outside the repository renders the example values shipped with the
package; a missing or invalid values file is one line of error and writes nothing (it left an empty
``deploy/kuberay/`` and a traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _manifests(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # this checkout, wherever the command runs
    return subprocess.run(
        [sys.executable, "-m", "cli", "manifests", *args], cwd=cwd, env=env, capture_output=True, text=True
    )


def test_outside_the_repository_it_renders_the_shipped_example(tmp_path):
    done = _manifests(tmp_path, "--out", "k8s")
    assert done.returncode == 0, done.stderr
    for name in ("serve_config.yaml", "rayservice.yaml", "redis.yaml"):
        assert (tmp_path / "k8s" / name).read_text() == (ROOT / "deploy" / "kuberay" / name).read_text()


def test_a_bad_values_file_is_one_line_and_writes_nothing(tmp_path):
    done = _manifests(tmp_path, "--values", "nope.yaml", "--out", "k8s")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "nope.yaml" in done.stderr
    (tmp_path / "bad.yaml").write_text("name: [unclosed\n")
    done = _manifests(tmp_path, "--values", "bad.yaml", "--out", "k8s")
    assert done.returncode == 2 and "Traceback" not in done.stderr and "invalid values file" in done.stderr
    assert 'in "bad.yaml", line 2' in done.stderr and "<unicode string>" not in done.stderr  # where it is
    (tmp_path / "wrong.yaml").write_text("name: x\nreplicas: lots\n")
    done = _manifests(tmp_path, "--values", "wrong.yaml", "--out", "k8s")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    # One line per problem, named by its field, without pydantic's documentation links.
    assert (
        "replicas: Extra inputs are not permitted" in done.stderr and "errors.pydantic.dev" not in done.stderr
    )
    assert done.stderr.count("\n") == 1
    assert not (tmp_path / "k8s").exists()
