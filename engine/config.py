"""Engine configuration: one validated dataclass that every role (offline, prefill, decode) shares."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCHEDULING_POLICIES = ("fifo", "prefill_first", "priority")
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of float32, bfloat16, float16")
    return _DTYPES[dtype]


@dataclass(slots=True)
class EngineConfig:
    """Everything an engine needs to start.

    KV pool size: ``num_blocks`` pins it; otherwise it comes from ``kv_cache_memory_bytes`` on CPU or
    ``gpu_memory_utilization`` of the device's free memory on CUDA. ``swap_space`` (GiB) > 0 adds a
    CPU block pool and makes preemption swap instead of recompute.
    """

    model: str
    tokenizer: str | None = None
    dtype: str | torch.dtype = "float32"
    device: str = "cpu"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    gpu_memory_utilization: float = 0.9
    swap_space: float = 0.0
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    scheduling_policy: str = "fifo"
    admission_margin: float = 0.01
    attention_backend: str = "auto"
    cache_salt: str = ""
    # Decode steps replayed from CUDA graphs (CUDA + Triton backend only; False: always eager).
    cuda_graphs: bool = True
    cuda_graph_max_batch: int = 256

    def __post_init__(self) -> None:
        self.dtype = parse_dtype(self.dtype)
        _positive("block_size", self.block_size)
        if self.block_size > 256 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two <= 256, got {self.block_size}")
        if self.num_blocks is not None:
            _positive("num_blocks", self.num_blocks)
        _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("cuda_graph_max_batch", self.cuda_graph_max_batch)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}"
            )
        if not 0 <= self.admission_margin < 1:
            raise ValueError(f"admission_margin must be a fraction in [0, 1), got {self.admission_margin}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}"
            )


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
