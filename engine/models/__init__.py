from engine.models.llama import LlamaForCausalLM, ModelSpec
from engine.models.loader import SUPPORTED_ARCHITECTURES, load_model, resolve_model_path, spec_from_hf_config
from engine.models.zero_cost import ZeroCostForCausalLM, create_zero_cost_model

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "LlamaForCausalLM",
    "ModelSpec",
    "ZeroCostForCausalLM",
    "create_zero_cost_model",
    "load_model",
    "resolve_model_path",
    "spec_from_hf_config",
]
