"""Command-line flags for an ``EngineConfig``, shared by every entry point that runs an engine."""

from __future__ import annotations

import argparse

from engine.config import SCHEDULING_POLICIES, EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", required=True, help="checkpoint directory or Hugging Face id")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default="cpu")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-blocks", type=int, default=None, help="pin the KV pool (default: from memory)")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30, help="CPU KV budget")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--swap-space", type=float, default=0.0, help="GiB of CPU blocks for swap preemption")
    g.add_argument("--scheduling-policy", default="fifo", choices=SCHEDULING_POLICIES)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--cache-salt", default="")
    g.add_argument("--no-cuda-graphs", action="store_true", help="run every decode step eagerly on CUDA")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        swap_space=args.swap_space,
        scheduling_policy=args.scheduling_policy,
        enable_prefix_caching=not args.no_prefix_caching,
        seed=args.seed,
        cache_salt=args.cache_salt,
        cuda_graphs=not args.no_cuda_graphs,
    )
