"""Attention backends over the paged, block-major KV cache."""

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend


def get_attention_backend(name: str, device: str) -> AttentionBackend:
    """``auto`` picks Triton on CUDA (when it lands) and the torch reference elsewhere."""
    if name in ("auto", "torch"):
        return TorchAttentionBackend()
    raise ValueError(f"attention backend {name!r} is not available in this build; use 'torch'")


__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "get_attention_backend"]
