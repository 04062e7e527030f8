"""The Llama family (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache.

One module covers the family; the differences are configuration: attention biases (Qwen2), q/k
RMSNorm over the head dim (Qwen3), sliding windows (Mistral, some Qwen2 layers), tied embeddings.
Parameter names follow the Hugging Face checkpoints, except that q/k/v and gate/up projections are
fused (the loader concatenates them) so each layer runs two matmuls fewer.

Layers pass ``(x, residual)`` along, whose sum is the hidden state, so that a residual add is fused
into the next RMSNorm. With ``fused`` (the default on CUDA tensors) the small ops run as Triton
kernels (``engine/models/fused_ops.py``); otherwise the torch code below runs, which on CPU matches
Hugging Face transformers bit for bit in float32. NOTE: ``fused_ops`` is imported where it is first
used, so CPU installs never import triton and tests can set ``TRITON_INTERPRET`` before its kernels
are defined.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.models.rotary import RotaryEmbedding, apply_rotary


@dataclass(frozen=True, slots=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict
    max_position_embeddings: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_windows: tuple[int | None, ...]  # per layer


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        if fused:
            import engine.models.fused_ops as fused_ops

            return fused_ops.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one fused op; same math as the reference below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor, fused: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``s = x + residual``; returns ``(norm(s), s)``."""
        if fused:
            import engine.models.fused_ops as fused_ops

            return fused_ops.add_rms_norm(x, residual, self.weight, self.eps)
        x = x + residual
        return self.forward(x), x


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.scale = spec.head_dim**-0.5
        self.sliding_window = spec.sliding_windows[layer]
        self.backend = backend

    def forward(self, x, cos_sin, kv_cache, meta: AttentionMetadata, fused: bool = False) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        lora = meta.lora if meta is not None else None
        if lora is not None:
            lora.update(qkv, x, self.layer, "qkv")
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q, fused), self.k_norm(k, fused)
        q, k = apply_rotary(q, k, cos_sin, fused)
        out = self.backend.forward(self.layer, q, k, v, kv_cache, meta, self.scale, self.sliding_window)
        out = out.reshape(t, self.q_size)
        y = self.o_proj(out)
        if lora is not None:
            lora.update(y, out, self.layer, "o")
        return y


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int = 0) -> None:
        super().__init__()
        self.layer = layer
        self.inter = spec.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor, fused: bool = False, lora=None) -> torch.Tensor:
        """``lora``: the step's adapters (``engine.lora.batch.LoraBatch``) or None."""
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            lora.update(gate_up, x, self.layer, "gate_up")
        if fused:
            import engine.models.fused_ops as fused_ops

            h = fused_ops.silu_mul(gate_up)
        else:
            gate, up = gate_up.split(self.inter, dim=-1)
            h = F.silu(gate) * up
        y = self.down_proj(h)
        if lora is not None:
            lora.update(y, h, self.layer, "down")
        return y


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer, backend)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec, layer)

    def forward(self, x, residual, cos_sin, kv_cache, meta, fused: bool = False):
        """``(x, residual)`` in, ``(mlp output, residual)`` out; ``residual`` is None for the first layer."""
        if residual is None:
            h, residual = self.input_layernorm(x, fused), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual, fused)
        x = self.self_attn(h, cos_sin, kv_cache, meta, fused)
        h, residual = self.post_attention_layernorm.add_forward(x, residual, fused)
        return self.mlp(h, fused, meta.lora if meta is not None else None), residual


class Backbone(nn.Module):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, spec.rope)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, backend) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend) -> None:
        super().__init__()
        self.spec = spec
        self.model = Backbone(spec, backend)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids,
        positions,
        kv_cache,
        meta: AttentionMetadata,
        num_layers: int | None = None,
        fused: bool | None = None,
    ) -> torch.Tensor:
        """Hidden states after all layers, or after the first ``num_layers`` (an early-exit draft).

        ``fused``: run the small ops as Triton kernels; None picks them for CUDA tensors (a property of
        the tensor, so the choice costs no host sync and holds under CUDA-graph capture).
        """
        x = self.model.embed_tokens(input_ids)
        fused = x.is_cuda if fused is None else fused
        cos_sin = self.model.rotary.lookup(positions, x.dtype)
        layers = self.model.layers
        residual = None
        for i in range(len(layers) if num_layers is None else num_layers):
            x, residual = layers[i](x, residual, cos_sin, kv_cache, meta, fused)
        return x if residual is None else x + residual

    def compute_logits(self, hidden: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
        fused = hidden.is_cuda if fused is None else fused
        return self.lm_head(self.model.norm(hidden, fused)).float()
