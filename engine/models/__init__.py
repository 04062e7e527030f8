from engine.models.llama import LlamaForCausalLM, ModelSpec
from engine.models.loader import SUPPORTED_ARCHITECTURES, load_model, resolve_model_path, spec_from_hf_config

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "LlamaForCausalLM",
    "ModelSpec",
    "load_model",
    "resolve_model_path",
    "spec_from_hf_config",
]
