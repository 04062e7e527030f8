"""The speculative-decoding option, configured as vLLM's ``speculative_config``.

Methods:
- ``draft_model``: a smaller model with the target's tokenizer (``"model"``: a path or Hugging Face
  id) proposes ``num_speculative_tokens`` tokens one at a time; it keeps its own KV cache, laid out
  on the target's block tables.
- ``ngram``: prompt lookup. The longest suffix of the sequence (``prompt_lookup_max`` tokens down to
  ``prompt_lookup_min``) that occurred earlier in it proposes the tokens that followed it then.
- ``early_exit``: the target's first ``num_layers`` layers plus its final norm and head are the draft
  (self-speculation). Those layers' KV is the target's own, so the draft needs no cache of its own.

Torch-free: the option is declared with the engine's others (engine/config.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SPEC_METHODS = ("draft_model", "ngram", "early_exit")
MAX_SPECULATIVE_TOKENS = 16
_KEYS = {
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "num_layers",
    "disable_by_batch_size",
}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None  # draft_model
    prompt_lookup_max: int = 4  # ngram
    prompt_lookup_min: int = 1
    num_layers: int = 1  # early_exit
    # Speculate only while fewer requests than this run (vLLM's speculative_disable_by_batch_size):
    # a large batch is compute-bound already, and verifying k + 1 positions costs more than it saves.
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the option's value: a dict, its JSON text, or None (off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise ValueError('speculative_config must be a JSON object, e.g. {"method": "ngram"}')
        unknown = set(value) - _KEYS
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)}; known: {sorted(_KEYS)}")
        method = value.get("method")
        if method is None and value.get("model"):
            method = "draft_model"  # as vLLM: a model alone means a draft model
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config method must be one of {SPEC_METHODS}, got {method!r}")
        k = value.get("num_speculative_tokens", 4 if method != "ngram" else 3)
        _int_in("num_speculative_tokens", k, 1, MAX_SPECULATIVE_TOKENS)
        lookup_max = value.get("prompt_lookup_max", 4)
        lookup_min = value.get("prompt_lookup_min", 1)
        _int_in("prompt_lookup_max", lookup_max, 1, 64)
        _int_in("prompt_lookup_min", lookup_min, 1, lookup_max)
        num_layers = value.get("num_layers", 1)
        _int_in("num_layers", num_layers, 1, 1 << 10)
        disable = value.get("disable_by_batch_size")
        if disable is not None:
            _int_in("disable_by_batch_size", disable, 1, 1 << 20)
        model = value.get("model")
        if method == "draft_model" and not (isinstance(model, str) and model):
            raise ValueError('speculative_config method "draft_model" needs "model": the draft\'s path or id')
        if method != "draft_model" and model is not None:
            raise ValueError(f'speculative_config "model" is only for method "draft_model", not {method!r}')
        return cls(method, k, model, lookup_max, lookup_min, num_layers, disable)

    def describe(self) -> str:
        extra = {
            "draft_model": f"model={self.model}",
            "ngram": f"lookup={self.prompt_lookup_min}..{self.prompt_lookup_max}",
            "early_exit": f"num_layers={self.num_layers}",
        }[self.method]
        off = f", off at batch >= {self.disable_by_batch_size}" if self.disable_by_batch_size else ""
        return f"{self.method} (k={self.num_speculative_tokens}, {extra}{off})"


def _int_in(name: str, x: object, lo: int, hi: int) -> None:
    if not isinstance(x, int) or isinstance(x, bool) or not lo <= x <= hi:
        raise ValueError(f"speculative_config {name} must be an integer in [{lo}, {hi}], got {x!r}")
