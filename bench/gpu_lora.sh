#!/usr/bin/env bash
# One call on a bare GPU host (Python 3.12 with torch, triton, transformers): the multi-LoRA Triton
# kernels compiled and checked against the torch reference (tests/engine/test_lora_kernels.py), adapter
# decode steps captured in CUDA graphs and replayed token-identical (tests/engine/test_cuda_graphs.py), then
# bench.lora_throughput on the ~0.3B random-weight Llama of gpu_setup.sh, bf16: 8 rank-16 adapters
# mixed uniformly vs the base model alone, and 2 slots for the 8 (swaps). A few minutes on one H100.
#
# Here, first:  bash bench/gpu_wheels.sh      (cp312 wheels of what the host lacks, into .whl/)
# Then the device tool:  run(command="bash bench/gpu_lora.sh", carry=[".whl"], timeout_s=420)
# Figures land in $OUT (the device tool's folder) or bench/results.
set -uo pipefail
DEST=${OUT:-$PWD/bench/results}
mkdir -p "$DEST"
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/gpu_setup.sh"
timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/engine/test_lora_kernels.py \
  tests/engine/test_cuda_graphs.py 2>&1 | tail -3
timeout 240 "$PY" -m bench.lora_throughput --model "$MODELS/llama-0.3b" --device cuda --dtype bfloat16 \
  --requests 256 --prompt-len 512 --output-len 128 --num-blocks 8192 --rounds 2 \
  --output "$DEST/lora_throughput_gpu.json"
