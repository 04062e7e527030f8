#!/usr/bin/env bash
# One call on a bare GPU host: the split served path (decode worker + its engine process, router,
# ingress; aggregated, in-process KV) against the engine alone, with prompts computed as they arrive
# (--prefill-hold-steps 0) and held for others up to 4 and 8 decode steps (engine option
# prefill_hold_steps), on the tiny and the ~0.3B random-weight Llama, 128/128 and 16/16, 32 in flight.
# Each run prints steps per request and the share of steps replayed from a decode CUDA graph.
#
# Here, first:  bash bench/gpu_wheels.sh
# Then the device tool:  run(command="bash bench/gpu_prefill_hold.sh", carry=[".whl"], timeout_s=420)
set -uo pipefail
DEST=${OUT:-$PWD/bench/results}
mkdir -p "$DEST"
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/gpu_setup.sh"
COMMON=(--device cuda --dtype bfloat16 --no-disagg --workloads 128/128,16/16 --num-requests 192
  --concurrency 32 --num-blocks 4096)
for m in llama-0.3b tiny; do
  for hold in 0 4 8; do
    layouts=split
    [ "$hold" = 0 ] && layouts=engine,split  # the engine alone once per model, in the same call
    echo "== $m, prefill_hold_steps $hold"
    timeout 110 "$PY" -m bench.served_path --model "$MODELS/$m" "${COMMON[@]}" --layouts "$layouts" \
      --prefill-hold-steps "$hold" --output "$DEST/prefill_hold_gpu_${m}_$hold.json"
  done
done
