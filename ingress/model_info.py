"""What the HTTP ingress knows of the model without running it: tokenizer, vocabulary, context.

Everything the edge validates against (token ids in the vocabulary, prompt + max_tokens within the
context) comes from here, so a bad request is refused before any worker is touched.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.model_names import builtin_model_dir
from ingress.adapters import AdapterNames

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str  # what clients put in "model"
    path: str  # the resolved checkpoint directory
    vocab_size: int
    max_model_len: int
    tiny: bool  # a random-weight demo model
    tokenizer: Any
    adapters: AdapterNames = field(default_factory=AdapterNames)  # LoRA adapters "model" may name


def load_model_info(model: str, name: str, max_model_len: int | None, tiny: bool) -> ModelInfo:
    from transformers import AutoConfig, AutoTokenizer

    path = builtin_model_dir(model) or Path(model).expanduser()
    if not path.is_dir():  # a Hugging Face id: the ingress needs the config and tokenizer, not weights
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(model, allow_patterns=["*.json", "*.model", "*.txt", "*.jinja"]))
    cfg = AutoConfig.from_pretrained(path)
    limit = cfg.max_position_embeddings
    if max_model_len is not None and max_model_len > limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's context of {limit}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    # The engine's vocabulary (the LM head) is the bound for token ids; a tokenizer may know fewer.
    return ModelInfo(
        name=name,
        path=str(path),
        vocab_size=cfg.vocab_size,
        max_model_len=max_model_len or limit,
        tiny=tiny,
        tokenizer=tokenizer,
        adapters=AdapterNames(base=name),
    )
