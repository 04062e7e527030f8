"""A PEFT LoRA adapter read from disk and checked against the base model it is served with.

The format is PEFT's (``save_pretrained``): ``adapter_config.json`` and ``adapter_model.safetensors``
whose keys name the base model's modules (``base_model.model.model.layers.3.self_attn.q_proj.lora_A
.weight``, ``[r, in]``; ``lora_B``: ``[out, r]``). Every projection of a layer can be adapted: q, k, v
and o of attention, gate, up and down of the MLP. The update of a projection ``W`` is
``x @ A.T @ B.T * scale`` with ``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA), per
module when ``rank_pattern``/``alpha_pattern`` give a module its own rank or alpha.

Everything the engine cannot serve exactly is refused with the reason, before any weight is used:
DoRA, adapted biases, trained modules besides LoRA (``modules_to_save``), embedding or LM-head
adapters, a rank above the engine's ``max_lora_rank``, shapes that do not fit the base model, and
pickled ``adapter_model.bin`` checkpoints (never unpickled: convert them to safetensors).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

# HF projection -> (the engine's fused projection, its part): parts are concatenated along the output.
TARGETS = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
NUM_PARTS = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter the engine cannot serve; the message says why."""


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One adapted HF projection: ``A`` ``[r, in]``, ``B`` ``[out, r]`` with its scale folded in."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    name: str
    path: str
    rank: int  # the largest rank of its modules
    digest: str  # of its weights and config: the prefix cache's namespace for it
    modules: dict[tuple[int, str, int], LoraModule]  # (layer, fused projection, part) -> weights

    @property
    def cache_salt(self) -> str:
        return f"|lora={self.digest}"


def load_adapter(name: str, path: str | Path, spec, max_rank: int) -> LoraAdapter:
    """Read and check the adapter at ``path`` for a base model of ``spec`` (an engine ModelSpec)."""
    from safetensors.torch import load_file

    path = Path(path)
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise AdapterError(f"adapter {name!r}: no adapter_config.json in {path}")
    raw_config = config_file.read_bytes()
    try:
        config = json.loads(raw_config)
    except json.JSONDecodeError as exc:
        raise AdapterError(f"adapter {name!r}: adapter_config.json is not JSON ({exc})") from None
    _check_config(name, config)
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        pickled = (path / "adapter_model.bin").is_file()
        raise AdapterError(
            f"adapter {name!r}: no adapter_model.safetensors in {path}"
            + (
                " (adapter_model.bin is a pickle, which pdserve never loads: convert it to safetensors)"
                if pickled
                else ""
            )
        )
    try:
        tensors = load_file(str(weights_file))
    except Exception as exc:  # a truncated or foreign file: safetensors says what is wrong
        raise AdapterError(f"adapter {name!r}: cannot read adapter_model.safetensors ({exc})") from None
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise AdapterError(
                f"adapter {name!r}: weight {key!r} does not adapt an attention or MLP projection"
            )
        layer, proj, ab = int(m[1]), m[2], m[3]
        if proj not in TARGETS:
            raise AdapterError(
                f"adapter {name!r}: {proj!r} is not a projection pdserve adapts ({', '.join(TARGETS)})"
            )
        pairs.setdefault((layer, proj), {})[ab] = tensor
    if not pairs:
        raise AdapterError(f"adapter {name!r}: adapter_model.safetensors holds no LoRA weights")
    modules = {}
    for (layer, proj), ab in sorted(pairs.items()):
        modules[(layer, *TARGETS[proj])] = _module(name, config, layer, proj, ab, spec, max_rank)
    digest = hashlib.blake2b(raw_config + weights_file.read_bytes(), digest_size=12).hexdigest()
    rank = max(m.rank for m in modules.values())
    return LoraAdapter(name, str(path), rank, digest, modules)


def _check_config(name: str, config: dict) -> None:
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r}: adapter_config.json is not an object")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {kind!r} is not LoRA")
    if config.get("use_dora"):
        raise AdapterError(f"adapter {name!r}: DoRA adapters are not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"adapter {name!r}: adapted biases (bias={config['bias']!r}) are not supported")
    if config.get("modules_to_save"):
        raise AdapterError(f"adapter {name!r}: modules_to_save {config['modules_to_save']} are not supported")
    if config.get("fan_in_fan_out"):
        raise AdapterError(f"adapter {name!r}: fan_in_fan_out (Conv1D bases) is not supported")
    for field in ("r", "lora_alpha"):
        value = config.get(field)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise AdapterError(f"adapter {name!r}: {field} must be a positive number, got {value!r}")


def _pattern(patterns: dict, layer: int, proj: str, default):
    """PEFT's per-module override (``peft.utils.other.get_pattern_key``): the first key, in the
    file's order, that matches the module's name as a regular expression (the whole name, or its
    end after a dot; a key with ``|`` is one expression), else ``default``."""
    module = f"model.layers.{layer}.{'mlp' if proj in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{proj}"
    for key, value in (patterns or {}).items():
        try:
            matched = re.match(rf"(.*\.)?({key})$", module)
        except re.error as e:
            raise AdapterError(f"pattern {key!r} is not a regular expression: {e}") from None
        if matched:
            return value
    return default


def _module(name: str, config: dict, layer: int, proj: str, ab: dict, spec, max_rank: int) -> LoraModule:
    where = f"adapter {name!r}: layer {layer} {proj}"
    if set(ab) != {"A", "B"}:
        raise AdapterError(f"{where} has lora_{'A' if 'A' in ab else 'B'} without its partner")
    a, b = ab["A"], ab["B"]
    if layer >= spec.num_layers:
        raise AdapterError(f"{where}: the base model has {spec.num_layers} layers")
    out_dim, in_dim = _shape(proj, spec)
    rank = a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (rank, in_dim) or tuple(b.shape) != (out_dim, rank):
        raise AdapterError(
            f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the base model's "
            f"[{out_dim}, {in_dim}] projection"
        )
    if rank > max_rank:
        raise AdapterError(f"{where}: rank {rank} exceeds max_lora_rank {max_rank}")
    alpha = _pattern(config.get("alpha_pattern"), layer, proj, config["lora_alpha"])
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoraModule(a.float().contiguous(), (b.float() * scale).contiguous())


def _shape(proj: str, spec) -> tuple[int, int]:
    """(out, in) of an HF projection of the base model."""
    h, q, kv, inter = (
        spec.hidden_size,
        spec.num_heads * spec.head_dim,
        spec.num_kv_heads * spec.head_dim,
        spec.intermediate_size,
    )
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (inter, h),
        "up_proj": (inter, h),
        "down_proj": (h, inter),
    }[proj]


def save_adapter(
    path: str | Path,
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
    lora_alpha: float,
    base_model: str = "",
) -> Path:
    """Write an adapter in PEFT's format: ``weights`` maps (layer, HF projection) to its ``A``
    ``[r, in]`` and ``B`` ``[out, r]`` (unscaled). ``peft.PeftModel.from_pretrained`` loads it, as
    does ``load_adapter``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ranks = {a.shape[0] for a, _ in weights.values()}
    if len(ranks) != 1:
        raise ValueError(f"one rank for every module, got {sorted(ranks)}")
    tensors = {}
    for (layer, proj), (a, b) in sorted(weights.items()):
        part = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        key = f"base_model.model.model.layers.{layer}.{part}.{proj}"
        tensors[f"{key}.lora_A.weight"] = a.detach().float().contiguous().cpu()
        tensors[f"{key}.lora_B.weight"] = b.detach().float().contiguous().cpu()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": ranks.pop(),
        "lora_alpha": lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted({proj for _, proj in weights}),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def random_adapter(
    path: str | Path, spec, rank: int, seed: int, scale: float = 0.05, targets=tuple(TARGETS)
) -> Path:
    """An adapter of random weights on every layer's ``targets`` (benchmarks, demos of mechanics)."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(spec.num_layers):
        for proj in targets:
            out_dim, in_dim = _shape(proj, spec)
            weights[(layer, proj)] = (
                scale * torch.randn(rank, in_dim, generator=gen),
                scale * torch.randn(out_dim, rank, generator=gen),
            )
    return save_adapter(path, weights, lora_alpha=2 * rank)
