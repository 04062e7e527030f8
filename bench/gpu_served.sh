#!/usr/bin/env bash
# One call on a bare GPU host (no Ray, no NIXL, no Redis server; Python 3.12 with torch, triton,
# transformers, grpcio, aiohttp): the served path against the engine alone (bench.served_path,
# aggregated, standalone processes, the in-process KV backend; the decode worker's engine on a thread
# of its process ("stack") and in a process of its own ("split")) on a tiny (~32M) and a ~0.3B
# random-weight Llama, 128/128 and 16/16, 32 in flight. Well under 5 minutes on one H100.
#
# Here, first:  bash bench/gpu_wheels.sh      (cp312 wheels of what the host lacks, into .whl/)
# Then the device tool:  run(command="bash bench/gpu_served.sh", carry=[".whl"], timeout_s=420)
# Figures land in $OUT (the device tool's folder) or bench/results.
set -uo pipefail
DEST=${OUT:-$PWD/bench/results}
mkdir -p "$DEST"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
if [ -d .whl ]; then
  "$PY" -m pip install --quiet --no-index --find-links .whl \
    fastapi uvicorn uvloop httptools pydantic redis fakeredis prometheus-client pyyaml 2>&1 | tail -2
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
MODELS=${MODELS:-/tmp/pdserve-models}
"$PY" - "$MODELS" <<'PYEOF'
import sys
from pathlib import Path

from engine.tiny_model import LLAMA_32M, create_tiny_model

root = Path(sys.argv[1])
LLAMA_03B = dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=20,
                 num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096)
for name, shape in (("tiny", LLAMA_32M), ("llama-0.3b", LLAMA_03B)):
    if not (root / name / "config.json").exists():
        print(f"creating {name} in {root / name}", flush=True)
        create_tiny_model(root / name, "llama", **shape)
PYEOF
for m in tiny llama-0.3b; do
  echo "== $m"
  timeout 200 "$PY" -m bench.served_path --model "$MODELS/$m" --device cuda --dtype bfloat16 \
    --no-disagg --workloads 128/128,16/16 --num-requests 192 --concurrency 32 --num-blocks 4096 \
    --output "$DEST/served_path_gpu_$m.json"
done
