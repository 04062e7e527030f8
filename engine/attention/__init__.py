"""Attention backends over the paged, block-major KV cache."""

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend


def get_attention_backend(name: str, device: str) -> AttentionBackend:
    """``auto`` picks the Triton kernels on CUDA and the torch reference elsewhere."""
    if name == "triton" or (name == "auto" and str(device).startswith("cuda")):
        # NOTE: lazy, so CPU installs never import triton and tests can set TRITON_INTERPRET first.
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name in ("auto", "torch"):
        return TorchAttentionBackend()
    raise ValueError(f"attention backend {name!r} is not available in this build; use 'torch'")


__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "get_attention_backend"]
