"""Model names pdserve builds itself instead of loading: ``pdserve/zero-cost`` and ``pdserve/emulated``.

``pdserve/zero-cost`` is the zero-cost model (``engine.models.zero_cost``): the real scheduler,
batch building, sampler and output path around a forward that computes nothing, tokens walking a
fixed pattern. Passed wherever a model goes (``--model pdserve/zero-cost`` to ``pdserve serve``,
the standalone workers, the ingress, ``bench.served_path``), it measures the serving stack's own
CPU per token on any machine. ``pdserve/emulated`` is the same model on an emulated accelerator:
each step also waits, sleeping, as long as ``EMULATED_STEP_TIME`` says its work takes, so the
engines' time dominates the host's as on a GPU host, and routing, queueing and the planner
(``bench.planner_validation --model pdserve/emulated``) can be measured on a machine without one.
Each checkpoint directory (config and tokenizer, no weights) is written
once under ``~/.cache/pdserve`` by whichever process asks first; several processes starting at once
each write a private copy and rename it into place, so none reads a half-written one.

Torch-free: the ingress resolves names too.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

ZERO_COST = "pdserve/zero-cost"
EMULATED = "pdserve/emulated"
CACHE_DIR = Path.home() / ".cache" / "pdserve"
# The emulated accelerator's costs (``engine.models.zero_cost.StepTime``): 20 ms a forward, 0.2 ms a
# token, 0.1 us a context token attended. Chosen, not measured: a 128-token prompt takes 46 ms and a
# decode step of 32 sequences at context 256 27 ms, so at the rates such an engine serves, the
# front end's CPU on a 2-core machine stays a small share, as on a GPU host.
EMULATED_STEP_TIME = {"base_s": 0.020, "per_token_s": 0.0002, "per_ctx_s": 1e-7}
# Other costs, another directory (named by them): a checkpoint written for old costs is never read.
_COSTS = hashlib.sha256(json.dumps(EMULATED_STEP_TIME, sort_keys=True).encode()).hexdigest()[:8]
_DIRS = {ZERO_COST: "zero-cost", EMULATED: f"emulated-{_COSTS}"}


def builtin_model_dir(model: str, cache_dir: Path | None = None) -> Path | None:
    """The checkpoint directory of a built-in model name (created on first use); None for any other
    model string (a path or a Hugging Face id)."""
    name = _DIRS.get(model)
    if name is None:
        return None
    path = (cache_dir or CACHE_DIR) / name
    if not (path / "config.json").exists():
        _create(path, model == EMULATED)
    return path


def _create(path: Path, emulated: bool) -> None:
    from engine.models.zero_cost import StepTime, create_zero_cost_model

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    create_zero_cost_model(tmp, step_time=StepTime(**EMULATED_STEP_TIME) if emulated else None)
    try:
        tmp.rename(path)
    except OSError:  # another process put its copy in place first: theirs is as good
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        if not (path / "config.json").exists():
            raise
