"""Engine configuration: one validated dataclass that every role (offline, prefill, decode) shares.

It is also the one declaration of every engine option (default, help, choices): the CLI flags
(``engine.args``) and the Serve / KubeRay config (``deploy.config.EngineOptions``) are derived from
its fields, so a new option appears everywhere at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.spec_config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

SCHEDULING_POLICIES = ("fifo", "prefill_first", "priority", "fair")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
ASYNC_SCHEDULING = ("off", "on")
_DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    import torch  # NOTE: here, not at the top: the option declarations below stay torch-free

    allowed = {torch.float32, torch.bfloat16, torch.float16}
    if isinstance(dtype, torch.dtype):
        if dtype not in allowed:
            raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    if dtype not in _DTYPE_ALIASES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of float32, bfloat16, float16")
    return getattr(torch, _DTYPE_ALIASES[dtype])


def usable_device(device: str) -> torch.device:
    """``device`` as torch's, or a ValueError that says why this process cannot use it (checked
    where the engine is built: a config may be written on a host without the accelerator)."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: this torch ({torch.__version__}) sees no CUDA GPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: this host has {torch.cuda.device_count()} CUDA GPU(s)")
    return dev


def option(default, help: str, choices: tuple | None = None, flag: str | None = None):
    """A declared engine option: its default, help text and choices, which every surface reads
    (``engine.args`` for the CLI flags, ``deploy.config.EngineOptions`` for Serve and KubeRay)."""
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if flag is not None:
        meta["flag"] = flag  # an extra flag name kept for compatibility
    return field(default=default, metadata=meta)


DTYPE_NAMES = ("float32", "bfloat16", "float16")


@dataclass(slots=True)
class EngineConfig:
    """Everything an engine needs to start; every engine option is declared here, once.

    KV pool size: ``num_blocks`` pins it; otherwise it comes from ``kv_cache_memory_bytes`` on CPU or
    ``gpu_memory_utilization`` of the device's total memory on CUDA, less what is in use (weights).
    ``swap_space`` (GiB) > 0 adds a CPU block pool and makes preemption swap instead of recompute.
    """

    model: str = option("", "checkpoint directory or Hugging Face id")
    tokenizer: str | None = option(None, "tokenizer directory or id (default: the model's)")
    dtype: str | torch.dtype = option("float32", "weights and KV cache dtype", DTYPE_NAMES)
    kv_cache_dtype: str = option(
        "auto",
        "KV cache storage: auto (the model's dtype), int8 or fp8 (e4m3), with a scale per token, layer "
        "and KV head",
        KV_CACHE_DTYPES,
    )
    device: str = option("cpu", "engine device (cpu, cuda, cuda:N)")
    seed: int = option(0, "engine seed (seeded sampling reproduces across runs)")
    max_model_len: int | None = option(None, "context length (default: the model's)")
    block_size: int = option(16, "tokens per KV block (a power of two <= 256)")
    num_blocks: int | None = option(None, "pin the KV pool's size in blocks (default: from memory)")
    kv_cache_memory_bytes: int = option(1 << 30, "bytes of KV cache on CPU")
    gpu_memory_utilization: float = option(
        0.9,
        "fraction of the GPU's total memory this engine may use on CUDA: the KV cache gets what the weights and others leave of it",
    )
    swap_space: float = option(0.0, "GiB of CPU blocks for swap preemption (0: preempt by recompute)")
    kv_host_cache_gib: float = option(
        0.0,
        "GiB of host memory that keeps prefix blocks evicted from the KV pool, loaded back on a prefix hit "
        "instead of recomputed (0: off)",
    )
    kv_disk_cache_gib: float = option(
        0.0,
        "GiB of a file in kv_disk_cache_dir that keeps prefix blocks evicted from the host tier, read back "
        "on a prefix hit instead of recomputed (0: off; needs kv_host_cache_gib)",
    )
    kv_disk_cache_dir: str | None = option(
        None,
        "local directory of the disk tier's file, used as is (default: a fresh temporary directory); the "
        "file is unlinked once made, so any exit frees it",
    )
    enable_prefix_caching: bool = option(
        True, "reuse cached prompt blocks across requests", flag="--prefix-caching"
    )
    max_num_batched_tokens: int = option(2048, "token budget of one engine step (chunked prefill above it)")
    max_num_seqs: int = option(256, "most sequences in one step")
    scheduling_policy: str = option("fifo", "order of waiting requests", SCHEDULING_POLICIES)
    itl_target_ms: float = option(
        100.0, "fair policy: step time (ms) a step carrying decodes is sized to stay within"
    )
    admission_margin: float = option(0.01, "fraction of KV blocks kept free when admitting new requests")
    attention_backend: str = option(
        "auto", "attention kernels (auto: Triton on CUDA, torch elsewhere)", ATTENTION_BACKENDS
    )
    cache_salt: str = option(
        "", "namespace of the prefix-cache hashes (workers sharing a cache use the same)"
    )
    cpu_threads: int | None = option(
        None,
        "torch intra-op threads of the engine's process (default: 1 on a GPU, where more only spin; on CPU "
        "torch's, from OMP_NUM_THREADS: Ray sets it to a replica's CPUs)",
    )
    async_scheduling: str = option(
        "off",
        "overlap each step's scheduling and batch preparation with the previous step on the device, its "
        "tokens read one step behind (off by default: on an H200 it measured slower while the host's "
        "per-sequence work outlasts the GPU's step; bench/README.md)",
        ASYNC_SCHEDULING,
    )
    cuda_graphs: bool = option(True, "replay decode steps from CUDA graphs (CUDA + Triton backend only)")
    cuda_graph_max_batch: int = option(
        256, "largest batch captured in a CUDA graph (rows: a decode's token, or a mixed step's tokens)"
    )
    cuda_graph_mixed: bool = option(
        True,
        "replay steps that mix prompt chunks with decodes from the decode graphs too (up to "
        "cuda_graph_max_batch tokens, each prompt token run as a decode row; engine/cuda_graphs.py)",
    )
    enable_lora: bool = option(
        False, "serve LoRA adapters (loaded at start with lora_modules or at run time)"
    )
    lora_modules: dict | None = option(
        None, 'LoRA adapters (PEFT format) to serve from the start, as JSON: {"NAME": "PATH", ...}'
    )
    max_loras: int = option(4, "LoRA adapters resident on the device at once (the rest wait in host memory)")
    max_lora_rank: int = option(16, "largest LoRA rank served (the device slots' size)")
    speculative_config: dict | None = option(
        None,
        'speculative decoding, as JSON: {"method": "draft_model", "model": PATH} | {"method": "ngram", '
        '"prompt_lookup_max": 4} | {"method": "early_exit", "num_layers": 2}, each with '
        '"num_speculative_tokens": k',
    )

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
        _positive("max_loras", self.max_loras)
        _positive("max_lora_rank", self.max_lora_rank)
        if self.lora_modules is not None and not (
            isinstance(self.lora_modules, dict)
            and all(isinstance(v, str) for v in self.lora_modules.values())
        ):
            raise ValueError(f"lora_modules must map adapter names to paths, got {self.lora_modules!r}")
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.cpu_threads is not None:
            _positive("cpu_threads", self.cpu_threads)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("kv_host_cache_gib", "kv_disk_cache_gib", "swap_space"):
            _gib(name, getattr(self, name))
        if self.kv_disk_cache_gib and not self.kv_host_cache_gib:
            raise ValueError("kv_disk_cache_gib needs a host tier above it: set kv_host_cache_gib too")
        if self.kv_disk_cache_dir is not None and not self.kv_disk_cache_gib:
            raise ValueError("kv_disk_cache_dir is set but the disk tier is off: set kv_disk_cache_gib")
        if self.async_scheduling not in ASYNC_SCHEDULING:
            raise ValueError(
                f"async_scheduling must be one of {ASYNC_SCHEDULING}, got {self.async_scheduling!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}"
            )
        if not isinstance(self.itl_target_ms, (int, float)) or not self.itl_target_ms > 0:
            raise ValueError(f"itl_target_ms must be a positive number of ms, got {self.itl_target_ms}")
        if not 0 <= self.admission_margin < 1:
            raise ValueError(f"admission_margin must be a fraction in [0, 1), got {self.admission_margin}")
        if not self.model:
            raise ValueError("model is required (a checkpoint directory or Hugging Face id)")
        self.speculative  # noqa: B018 (a bad speculative_config is refused here, with the others)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}"
            )

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)


def _gib(name: str, value: float) -> None:
    """A size in GiB: a finite number >= 0 (NaN and inf used to reach an allocation's traceback)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{name} must be a finite number >= 0 GiB, got {value!r}")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
