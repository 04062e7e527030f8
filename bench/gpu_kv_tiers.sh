#!/usr/bin/env bash
# One call on a bare GPU host (Python 3.12 with torch, triton, transformers): issue 33's KV cache tiers
# where they are meant to run. bench.kv_tiers on the ~0.3B random-weight Llama of gpu_setup.sh, bf16,
# the engine's KV pool on the GPU (160 blocks of 16 tokens, 640 KiB each) against a working set of
# ~860 blocks (5.4x): no tier, a 1 GiB pinned host tier (holds it all), a host tier of a quarter of
# it alone and with a 2 GiB disk tier under it; then the fitting workload. Every output compared
# across configurations, every block back in its pool. Then bench.kv_disk_writes (host memory and
# the host's disk: what a disk write costs the engine's thread there). A few minutes on one H100.
#
# Here, first:  bash bench/gpu_wheels.sh      (cp312 wheels of what the host lacks, into .whl/)
# Then the device tool:  run(command="bash bench/gpu_kv_tiers.sh", carry=[".whl"], timeout_s=540)
# Figures land in $OUT (the device tool's folder) or bench/results.
set -uo pipefail
DEST=${OUT:-$PWD/bench/results}
mkdir -p "$DEST"
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/gpu_setup.sh"
timeout 360 "$PY" -m bench.kv_tiers --model "$MODELS/llama-0.3b" --device cuda --dtype bfloat16 \
  --num-blocks 160 --host-gib 1.0 --disk-gib 2.0 --repeats 2 --output "$DEST/kv_tiers_gpu.json"
timeout 90 "$PY" -m bench.kv_disk_writes --output "$DEST/kv_disk_writes_gpu_host.json"
