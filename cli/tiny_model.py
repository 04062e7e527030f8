"""The tiny random-weight Llama that commands use when no ``--model`` is given (created once, cached)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

TINY_MODEL_DIR = Path.home() / ".cache" / "pdserve" / "tiny-llama"


def ensure_tiny_model() -> Path:
    from engine.tiny_model import LLAMA_32M, build_tokenizer, create_tiny_model

    if not (TINY_MODEL_DIR / "config.json").exists():
        print(f"no --model given: creating a tiny random Llama in {TINY_MODEL_DIR}", file=sys.stderr)
        create_tiny_model(TINY_MODEL_DIR, "llama", **LLAMA_32M)
    else:
        if not (TINY_MODEL_DIR / "chat_template.jinja").exists():  # made before chat templates
            build_tokenizer(LLAMA_32M.get("vocab_size", 1024)).save_pretrained(TINY_MODEL_DIR)
        _widen_context(TINY_MODEL_DIR / "config.json", LLAMA_32M["max_position_embeddings"])
    return TINY_MODEL_DIR


def _widen_context(config_path: Path, positions: int) -> None:
    """A model made when the context was shorter gets today's (RoPE: the weights do not change)."""
    config = json.loads(config_path.read_text())
    if config.get("max_position_embeddings", positions) < positions:
        config["max_position_embeddings"] = positions
        tmp = config_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(config, indent=2))
        tmp.replace(config_path)
