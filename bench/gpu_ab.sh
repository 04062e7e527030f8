#!/usr/bin/env bash
# One call on a GPU host: the engine's decode and prefill figures (bench.gpu_bench) from an older
# tree and from this one in the same run, this one as it runs by default and with overlapped scheduling
# (--async-scheduling on), then the
# GPU-only tests. BASE is the older tree, e.g.
#   mkdir .baseline && git archive <commit> | tar -x -C .baseline   (and .baseline in .git/info/exclude)
# Figures land in $OUT (the device tool's folder) or bench/results.
set -uo pipefail
BASE=${1:-.baseline}
DEST=${OUT:-$PWD/bench/results}
mkdir -p "$DEST"
export PYTHONUNBUFFERED=1
SHAPES=(--device cuda --dtype bfloat16 --batches 1,32,256 --contexts 1024,4096)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== before: $BASE"
(cd "$BASE" && timeout 170 python3 -m bench.gpu_bench "${SHAPES[@]}" --profile 32,1024 --json "$DEST/gpu_ab_before.json")
echo "== after"
timeout 150 python3 -m bench.gpu_bench "${SHAPES[@]}" --profile 256,1024 --json "$DEST/gpu_ab_after.json"
echo "== after, overlapped steps"
timeout 170 python3 -m bench.gpu_bench "${SHAPES[@]}" --async-scheduling on --profile 256,1024 --json "$DEST/gpu_ab_overlap.json"
echo "== GPU tests"
TRITON_INTERPRET=0 timeout 150 python3 -m pytest -q -p no:warnings -p no:cacheprovider \
  tests/engine/test_cuda_graphs.py tests/engine/test_fused_ops.py tests/engine/test_async_scheduling.py \
  tests/engine/test_step_syncs.py -k "gpu or graph or fused"
