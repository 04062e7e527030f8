"""Load a Hugging Face checkpoint (config.json + safetensors, single or sharded) into our model.

``transformers`` parses the config; the weights are read with ``safetensors`` straight into our
modules, concatenating q/k/v and gate/up into their fused projections. A Hugging Face id instead of
a directory is resolved with ``huggingface_hub.snapshot_download`` (config, tokenizer, weights).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from engine.attention.backend import AttentionBackend
from engine.model_names import builtin_model_dir
from engine.models.llama import LlamaForCausalLM, ModelSpec
from engine.models.rotary import rope_positions, rope_type
from engine.models.zero_cost import ARCHITECTURE as ZERO_COST_ARCHITECTURE
from engine.models.zero_cost import build_zero_cost_model

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

# checkpoint name suffix -> (fused parameter suffix, shard index)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def resolve_model_path(model: str) -> Path:
    builtin = builtin_model_dir(model)
    if builtin is not None:
        return builtin
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/")):
        raise ValueError(f"model path {model!r} is not a checkpoint directory")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import EntryNotFoundError

    logger.info("resolving %s from the Hugging Face hub", model)
    try:
        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except (OSError, EntryNotFoundError) as exc:  # not found, gated, offline, no network
        raise ValueError(
            f"model {model!r} is no local directory, and from the Hugging Face hub: {_brief(exc)}"
        ) from None


def load_hf_config(path: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:  # no config.json, or one transformers cannot read
        raise ValueError(f"model {str(path)!r} has no usable config.json: {_brief(exc)}") from None


def check_model(model: str) -> None:
    """A ValueError that says what is wrong with the model, read without its weights: a path that is
    no checkpoint, a hub id that cannot be fetched, an architecture pdserve does not run."""
    cfg = load_hf_config(resolve_model_path(model))
    if ZERO_COST_ARCHITECTURE not in (getattr(cfg, "architectures", None) or []):
        spec_from_hf_config(cfg)


def _brief(exc: BaseException) -> str:
    """An error's message on one line, at most 300 characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def spec_from_hf_config(cfg) -> ModelSpec:
    archs = getattr(cfg, "architectures", None) or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"unsupported architecture {archs}; pdserve supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    rope = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    if "rope_theta" not in rope and getattr(cfg, "rope_theta", None) is not None:
        rope["rope_theta"] = cfg.rope_theta
    if getattr(cfg, "partial_rotary_factor", None) not in (None, 1, 1.0):
        rope.setdefault("partial_rotary_factor", cfg.partial_rotary_factor)
    _check_supported(cfg, rope)
    return ModelSpec(
        architecture=arch,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope=rope,
        max_position_embeddings=rope_positions(cfg.max_position_embeddings, rope),
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(getattr(cfg, "attention_bias", False)),
        o_bias=arch != "Qwen2ForCausalLM" and bool(getattr(cfg, "attention_bias", False)),
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        sliding_windows=_sliding_windows(cfg, arch),
    )


def _check_supported(cfg, rope: dict) -> None:
    """What the model's forward would compute differently from the checkpoint's, refused by name
    (the pre-start check and the loader share it): an MLP activation other than SiLU, a rope this
    engine does not compute, quantized weights."""
    act = getattr(cfg, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {act!r}: pdserve's MLP computes silu")
    rope_type(rope)
    quant = getattr(cfg, "quantization_config", None)
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else type(quant).__name__
        raise ValueError(f"quantized checkpoints ({method}) are not supported: give unquantized weights")


def _sliding_windows(cfg, arch: str) -> tuple[int | None, ...]:
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if arch == "MistralForCausalLM" and window:
        return (window,) * n
    if getattr(cfg, "use_sliding_window", False) and window:
        first = getattr(cfg, "max_window_layers", n)
        return tuple(window if i >= first else None for i in range(n))
    return (None,) * n


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path}")
    return files


def load_model(path: Path, dtype: torch.dtype, device: str, backend: AttentionBackend) -> LlamaForCausalLM:
    cfg = load_hf_config(path)
    if ZERO_COST_ARCHITECTURE in (getattr(cfg, "architectures", None) or []):  # a benchmark's stand-in
        return build_zero_cost_model(cfg, dtype, device)
    spec = spec_from_hf_config(cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(spec, backend)
    model = model.to_empty(device=device).to(dtype)
    if spec.tie_word_embeddings:  # NOTE: to_empty() materialises shared parameters separately
        model.lm_head.weight = model.model.embed_tokens.weight
    # Rotary tables are computed, not loaded: rebuild them on the real device in float32.
    _rebuild_rotary(model, spec, device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    files = _weight_files(path)
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not iterable)
                _load_one(params, name, st.get_tensor(name), spec, loaded)
    expected: set[str] = set()
    for n in params:
        fused = n.rsplit(".", 2)[-2] if n.count(".") >= 2 else ""
        shards = 3 if fused == "qkv_proj" else 2 if fused == "gate_up_proj" else 0
        if shards:
            expected.update(f"{n}#{i}" for i in range(shards))
        else:
            expected.add(n)
    if spec.tie_word_embeddings:
        loaded.add("lm_head.weight")
    missing = expected - loaded
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights: {sorted(missing)[:8]}")
    logger.info("loaded %s (%d tensors from %d files)", spec.architecture, len(loaded), len(files))
    return model.eval()


def _rebuild_rotary(model: LlamaForCausalLM, spec: ModelSpec, device: str) -> None:
    from engine.models.rotary import RotaryEmbedding

    model.model.rotary = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, spec.rope).to(device)


def _load_one(params: dict, name: str, tensor: torch.Tensor, spec: ModelSpec, loaded: set[str]) -> None:
    if "rotary_emb" in name:
        return
    parts = name.rsplit(".", 2)  # [..., proj, weight|bias]
    fused = _FUSED.get(parts[-2]) if len(parts) == 3 else None
    if fused is None:
        if name not in params:
            if name == "lm_head.weight" and spec.tie_word_embeddings:
                return
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        _copy(params[name], tensor, name)
        loaded.add(name)
        return
    target_name = f"{parts[0]}.{fused[0]}.{parts[-1]}"
    target = params[target_name]
    if fused[0] == "qkv_proj":
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        offsets = (0, q, q + kv, q + 2 * kv)
    else:
        offsets = (0, spec.intermediate_size, 2 * spec.intermediate_size)
    i = fused[1]
    _copy(target.data[offsets[i] : offsets[i + 1]], tensor, name)
    loaded.add(f"{target_name}#{i}")


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src.to(dst.dtype))


def eos_token_ids(path: Path) -> frozenset[int]:
    """The checkpoint's end-of-sequence ids (generation_config.json, then config.json)."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if f.exists():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list):
                ids.update(e for e in eos if isinstance(e, int))
    return frozenset(ids)
