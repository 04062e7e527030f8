#!/usr/bin/env bash
# The next lent GPU's checks, most telling first, in about 10 minutes of one call (issues 30 and 31):
#   1. the GPU-only tests, with the new one that raises on any stream sync while a step launches
#      (tests/engine/test_step_syncs.py) and on an overlapped step's collect;
#   2. the served path's 16/16 gap split between the engine and the stack: the engine alone fed in
#      cohorts ("engine") and as a served engine is fed ("engine_staggered"), against the served
#      "split" layout, on the ~0.3B model (bench.served_path, aggregated, in-process KV), and
#      "split_rh" (the router inside the HTTP process, as `pdserve serve` runs it by default);
#   3. what a step with a prompt in it costs against a decode step, replayed from the decode graphs
#      (cuda_graph_mixed, new: each prompt token a decode row) and launched eagerly, in one run
#      (bench.gpu_bench's mixed-step tables; the second, a 128-token turn over a cached 3,840-token
#      prefix, sits near the most prompt keys a replayed step may read: if eager wins there, the
#      budget, cuda_graphs.MIXED_BUDGET, is too generous);
#   4. step 2's 16/16 again with mixed steps eager (--no-cuda-graph-mixed): the served gap with and
#      without them on the same host;
#   5. step 3 with overlapped scheduling (--async-scheduling on): it was left off by default after
#      an H200 run in which it lost, and the syncs removed since sat on its path.
# Whatever runs out of time, the earlier parts' figures are already in $OUT.
#
# Here, first:  bash bench/gpu_wheels.sh      (cp312 wheels of what the host lacks, into .whl/)
# Then the device tool:  run(command="bash bench/gpu_next.sh", carry=[".whl"], timeout_s=570)
# A smoke run of the script itself on any machine: SMOKE=1 bash bench/gpu_next.sh (CPU, float32, the
# tiny model, a few requests; the GPU tests skip).
set -uo pipefail
DEST=${OUT:-$PWD/bench/results}
mkdir -p "$DEST"
export PYTHONUNBUFFERED=1
if [ -n "${SMOKE:-}" ] && [ -z "${PY:-}" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi  # this checkout's
source "$(dirname "$0")/gpu_setup.sh"
DEVICE=cuda DTYPE=bfloat16 MODEL=llama-0.3b N=192 QUICK=() CONTEXT=1024 INTERPRET=0
if [ -n "${SMOKE:-}" ]; then DEVICE=cpu DTYPE=float32 MODEL=tiny N=16 QUICK=(--quick) CONTEXT=128 INTERPRET=1; fi
echo "== 1. GPU tests"
TRITON_INTERPRET=$INTERPRET timeout 110 "$PY" -m pytest -q -p no:warnings -p no:cacheprovider \
  tests/engine/test_step_syncs.py tests/engine/test_async_scheduling.py tests/engine/test_cuda_graphs.py \
  -k "gpu or graph" 2>&1 | tail -15
SERVED=("$PY" -m bench.served_path --model "$MODELS/$MODEL" --device $DEVICE --dtype $DTYPE
  --layouts engine,engine_staggered,split,split_rh --num-requests $N --concurrency 32 --num-blocks 4096)
echo "== 2. engine fed in cohorts and staggered vs the served split layout, 0.3B"
timeout 220 "${SERVED[@]}" --workloads 16/16,128/128 --output "$DEST/served_path_gpu_next_$MODEL.json"
echo "== 3. mixed steps against decode steps, from the graphs and eager"
timeout 120 "$PY" -m bench.gpu_bench --device $DEVICE --dtype $DTYPE --batches 1,32,256 --contexts $CONTEXT \
  "${QUICK[@]}" --json "$DEST/gpu_next_bench.json"
echo "== 4. step 2's 16/16 with mixed steps eager"
timeout 90 "${SERVED[@]}" --workloads 16/16 --no-cuda-graph-mixed --ttft-requests 0 \
  --output "$DEST/served_path_gpu_next_${MODEL}_eager_mixed.json"
echo "== 5. step 3 overlapped (batches 1 and 32)"
timeout 40 "$PY" -m bench.gpu_bench --device $DEVICE --dtype $DTYPE --batches 1,32 --contexts $CONTEXT \
  --async-scheduling on "${QUICK[@]}" --json "$DEST/gpu_next_bench_overlap.json"
