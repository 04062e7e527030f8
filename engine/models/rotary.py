"""Rotary position embeddings (rotate-half convention of the Llama family), precomputed per position."""

from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "linear", "llama3")


def rope_type(rope: dict) -> str:
    """A config's rope type, checked (a ValueError for one pdserve does not compute: before the
    weights load, so ``pdserve serve`` refuses the model in a line)."""
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {kind!r}: pdserve supports {', '.join(ROPE_TYPES)}")
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    return kind


def rope_positions(max_position_embeddings: int, rope: dict) -> int:
    """The positions a model handles: linear scaling stretches its trained ones by the factor (as
    vLLM and HF read it); llama3's config already gives the stretched length."""
    if rope_type(rope) == "linear":
        return int(max_position_embeddings * float(rope["factor"]))
    return max_position_embeddings


def _inv_freq(head_dim: int, rope: dict) -> torch.Tensor:
    theta = float(rope.get("rope_theta", 10000.0))
    rotary_dim = int(head_dim * float(rope.get("partial_rotary_factor", 1.0)))
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    kind = rope_type(rope)
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(rope["factor"])
    if kind == "llama3":
        factor = float(rope["factor"])
        low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_len = float(rope["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise AssertionError(kind)  # rope_type refused it


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, max_positions: int, rope: dict) -> None:
        super().__init__()
        inv = _inv_freq(head_dim, rope)
        if inv.numel() * 2 != head_dim:
            raise ValueError("partial rotary embeddings are not supported")
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for a step's positions, [T, 1, D]: computed once per step, shared by all layers."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], fused: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, KVH, D]; the Llama family's rotate-half rotation.

    ``fused``: one Triton kernel for q and k (``engine/models/fused_ops.py``, imported lazily so CPU
    installs never import triton) instead of the torch ops below.
    """
    cos, sin = cos_sin
    if fused:
        import engine.models.fused_ops as fused_ops

        return fused_ops.rotary(q, k, cos, sin)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
