#!/usr/bin/env bash
# Sourced by the GPU serving scripts (gpu_served.sh): installs the carried wheels
# (.whl/, from bench/gpu_wheels.sh) on a bare GPU host and creates the two random-weight Llamas the
# runs serve, a tiny (~32M) and a ~0.3B, under $MODELS.
PY=${PY:-python3}
if [ -d .whl ]; then
  "$PY" -m pip install --quiet --no-index --find-links .whl \
    fastapi uvicorn uvloop httptools pydantic redis fakeredis prometheus-client pyyaml 2>&1 | tail -2
  # the generated stubs need this side's grpcio (a bare host may have an older one)
  "$PY" -m pip install --quiet --no-index --no-deps --upgrade --find-links .whl grpcio protobuf 2>&1 | tail -2
  "$PY" -m pip install --quiet --no-index --no-deps --find-links .whl psutil peft accelerate 2>&1 | tail -2
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
