#!/usr/bin/env bash
# One call on a bare GPU host (no Ray, no NIXL, no Redis server; Python 3.12 with torch, triton,
# transformers, grpcio, aiohttp): the served path against the engine alone (bench.served_path,
# aggregated, standalone processes, the in-process KV backend; the decode worker's engine on a thread
# of its process ("stack") and in a process of its own ("split"); the engine alone fed in cohorts
# ("engine") and with its arrivals spread as a served engine gets them ("engine_staggered")) on a
# tiny (~32M) and a ~0.3B
# random-weight Llama, 128/128 and 16/16, 32 in flight. Well under 5 minutes on one H100.
#
# Here, first:  bash bench/gpu_wheels.sh      (cp312 wheels of what the host lacks, into .whl/)
# Then the device tool:  run(command="bash bench/gpu_served.sh", carry=[".whl"], timeout_s=420)
# Figures land in $OUT (the device tool's folder) or bench/results.
set -uo pipefail
DEST=${OUT:-$PWD/bench/results}
mkdir -p "$DEST"
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/gpu_setup.sh"
for m in tiny llama-0.3b; do
  echo "== $m"
  timeout 225 "$PY" -m bench.served_path --model "$MODELS/$m" --device cuda --dtype bfloat16 \
    --no-disagg --workloads 128/128,16/16 --num-requests 192 --concurrency 32 --num-blocks 4096 \
    --output "$DEST/served_path_gpu_$m.json"
done
