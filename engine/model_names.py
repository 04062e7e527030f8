"""Model names pdserve builds itself instead of loading: ``pdserve/zero-cost``.

``pdserve/zero-cost`` is the zero-cost model (``engine.models.zero_cost``): the real scheduler,
batch building, sampler and output path around a forward that computes nothing, tokens walking a
fixed pattern. Passed wherever a model goes (``--model pdserve/zero-cost`` to ``pdserve serve``,
the standalone workers, the ingress, ``bench.served_path``), it measures the serving stack's own
CPU per token on any machine. Its checkpoint directory (config and tokenizer, no weights) is written
once under ``~/.cache/pdserve`` by whichever process asks first; several processes starting at once
each write a private copy and rename it into place, so none reads a half-written one.

Torch-free: the ingress resolves names too.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

ZERO_COST = "pdserve/zero-cost"
CACHE_DIR = Path.home() / ".cache" / "pdserve"


def builtin_model_dir(model: str, cache_dir: Path | None = None) -> Path | None:
    """The checkpoint directory of a built-in model name (created on first use); None for any other
    model string (a path or a Hugging Face id)."""
    if model != ZERO_COST:
        return None
    path = (cache_dir or CACHE_DIR) / "zero-cost"
    if not (path / "config.json").exists():
        _create_zero_cost(path)
    return path


def _create_zero_cost(path: Path) -> None:
    from engine.models.zero_cost import create_zero_cost_model

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".zero-cost-", dir=path.parent))
    create_zero_cost_model(tmp)
    try:
        tmp.rename(path)
    except OSError:  # another process put its copy in place first: theirs is as good
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        if not (path / "config.json").exists():
            raise
