#!/usr/bin/env bash
# Regenerate proto/pdserve_pb2*.py from proto/pdserve.proto (commit the result).
# tests/proto/test_generated_current.py fails when the committed code is stale.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. proto/pdserve.proto
