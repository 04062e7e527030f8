"""pdserve's model-execution core, shared by the prefill and decode roles."""

from engine.config import EngineConfig
from engine.engine_core import EngineCore, EngineStats
from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineCore",
    "EngineStats",
    "RequestOutput",
    "SamplingParams",
]
