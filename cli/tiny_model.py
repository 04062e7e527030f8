"""The tiny random-weight Llama that commands use when no ``--model`` is given (created once, cached)."""

from __future__ import annotations

import sys
from pathlib import Path

TINY_MODEL_DIR = Path.home() / ".cache" / "pdserve" / "tiny-llama"


def ensure_tiny_model() -> Path:
    from engine.tiny_model import LLAMA_32M, build_tokenizer, create_tiny_model

    if not (TINY_MODEL_DIR / "config.json").exists():
        print(f"no --model given: creating a tiny random Llama in {TINY_MODEL_DIR}", file=sys.stderr)
        create_tiny_model(TINY_MODEL_DIR, "llama", **LLAMA_32M)
    elif not (TINY_MODEL_DIR / "chat_template.jinja").exists():  # made before chat templates
        build_tokenizer(LLAMA_32M.get("vocab_size", 1024)).save_pretrained(TINY_MODEL_DIR)
    return TINY_MODEL_DIR
