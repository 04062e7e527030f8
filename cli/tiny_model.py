"""The tiny random-weight Llama that commands use when no ``--model`` is given (created once, cached).

Its tokenizer is a byte-level BPE trained on the Python standard library's sources, its vocabulary
exactly the model's: every text round-trips (a chat's "user", "assistant" and whatever the user
types), so the demo's chat answers with text, random as its weights are. A cached model of an older
recipe (``DEMO_VERSION``; before 2, a word-level vocabulary that turned most text into ``<unk>``) is
made anew.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

TINY_MODEL_DIR = Path.home() / ".cache" / "pdserve" / "tiny-llama"
DEMO_VERSION = 2
_MARKER = "pdserve-demo.json"
_CORPUS_FILES = 240  # the first files of the standard library, sorted: the same tokenizer everywhere


def ensure_tiny_model(target: Path | None = None) -> Path:
    from engine.tiny_model import LLAMA_32M

    target = target or TINY_MODEL_DIR
    if demo_version(target) != DEMO_VERSION:
        create_demo_model(target)
    else:
        _widen_context(target / "config.json", LLAMA_32M["max_position_embeddings"])
    return target


def demo_version(path: Path) -> int:
    try:
        return int(json.loads((path / _MARKER).read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0 if (path / "config.json").exists() else -1


def create_demo_model(target: Path) -> Path:
    """Tokenizer first (byte-level BPE of the model's vocabulary size), then the random weights;
    written beside ``target`` and moved into place, so an interrupted run leaves no half model."""
    from cli.train_tiny import corpus_files
    from engine.tiny_model import LLAMA_32M, build_byte_level_tokenizer, create_tiny_model

    print(f"no --model given: creating a tiny random Llama in {target}", file=sys.stderr)
    vocab = LLAMA_32M["vocab_size"]
    texts = [p.read_text(errors="replace") for p in corpus_files()[:_CORPUS_FILES]]
    tokenizer = build_byte_level_tokenizer(vocab, texts)
    if len(tokenizer) != vocab:  # the corpus is the standard library: it always has enough pairs
        raise RuntimeError(f"the demo tokenizer has {len(tokenizer)} entries, not the model's {vocab}")
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    create_tiny_model(tmp, "llama", **LLAMA_32M)
    for f in tmp.glob("*token*"):
        f.unlink()
    tokenizer.save_pretrained(tmp)
    (tmp / _MARKER).write_text(json.dumps({"version": DEMO_VERSION, "tokenizer": "byte-level BPE"}))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def _widen_context(config_path: Path, positions: int) -> None:
    """A model made when the context was shorter gets today's (RoPE: the weights do not change)."""
    config = json.loads(config_path.read_text())
    if config.get("max_position_embeddings", positions) < positions:
        config["max_position_embeddings"] = positions
        tmp = config_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(config, indent=2))
        tmp.replace(config_path)
