"""``pdserve serve`` with a model that cannot load is refused at once with one line that says why,
before Ray or Redis start (it used to start Ray, wait ~48 s for Serve to give up on the replicas and
end in a traceback, the cause only in a replica's log); the same check reads a model's config for
``pdserve plan``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.model_names import ZERO_COST
from engine.models.loader import check_model

ROOT = Path(__file__).resolve().parents[2]


def _serve(model: str, home: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HOME=str(home), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "cli", "serve", "--model", model, "--port", "0"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ("/nonexistent/checkpoint", "model path '/nonexistent/checkpoint' is not a checkpoint directory"),
        (
            "no-such-org/no-such-model",
            "'no-such-org/no-such-model' is no local directory, and from the Hugging Face hub:",
        ),
    ],
)
def test_serve_with_a_model_that_cannot_load_is_one_line_and_starts_nothing(tmp_path, model, says):
    done = _serve(model, tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and says in done.stderr, done.stderr
    assert "ray" not in done.stdout.lower() and "redis" not in done.stdout.lower()


def test_the_check_names_a_directory_without_a_config_and_passes_a_real_model(tmp_path, tiny_llama):
    with pytest.raises(ValueError, match=r"has no usable config\.json"):
        check_model(str(tmp_path))
    check_model(str(tiny_llama))
    check_model(ZERO_COST)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu': pdserve's MLP computes silu"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "unsupported rope_type 'dynamic'"),
        ({"partial_rotary_factor": 0.5}, "partial rotary embeddings are not supported"),
        (
            {"quantization_config": {"quant_method": "fp8"}},
            r"quantized checkpoints \(fp8\) are not supported",
        ),
    ],
)
def test_the_check_refuses_what_the_engine_would_compute_wrong_or_fail_on(
    tmp_path, tiny_llama, overrides, says
):
    """Read from the config alone, before any weight: an activation, a rope or quantized weights the
    engine does not compute (a non-SiLU MLP loaded and generated other tokens than HF's; the others
    passed the pre-start check and failed in every replica)."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | overrides))
    with pytest.raises(ValueError, match=says):
        check_model(str(model))
