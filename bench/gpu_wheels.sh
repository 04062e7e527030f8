#!/usr/bin/env bash
# cp312 wheels of what a bare GPU host lacks for the standalone serving stack (bench/gpu_served.sh),
# into .whl/ (ignored by git; the device tool carries it). Needs PyPI; ~25 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl \
  fastapi uvicorn uvloop httptools pydantic redis fakeredis prometheus-client pyyaml \
  "grpcio==$("$PY" -c "import grpc; print(grpc.__version__)")" \
  "protobuf==$("$PY" -c "import google.protobuf as p; print(p.__version__)")" psutil
# peft (the LoRA tests' reference, bench/gpu_lora.sh) without its dependencies: torch and
# transformers are the host's own
"$PY" -m pip download --quiet --no-deps -d .whl \
  "peft==$("$PY" -c "import peft; print(peft.__version__)")" \
  "accelerate==$("$PY" -c "import accelerate; print(accelerate.__version__)")"
du -sh .whl
