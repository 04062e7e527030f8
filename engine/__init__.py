"""pdserve's model-execution core, shared by the prefill and decode roles.

NOTE: the public names load lazily, so ``import engine.block_hash`` (the router does) pulls in no
torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "LLM": "engine.llm",
    "CompletionOutput": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "EngineConfig": "engine.config",
    "EngineCore": "engine.engine_core",
    "EngineStats": "engine.engine_core",
    "SamplingParams": "engine.sampling_params",
    "StructuredOutput": "engine.sampling_params",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineCore",
    "EngineStats",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutput",
]

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.engine_core import EngineCore, EngineStats
    from engine.llm import LLM
    from engine.outputs import CompletionOutput, RequestOutput
    from engine.sampling_params import SamplingParams, StructuredOutput


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
