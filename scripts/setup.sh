#!/usr/bin/env bash
# Create (or reuse) .venv and install pdserve with its test extra.
# torch goes first and only if missing: an unpinned `torch` from PyPI pulls several GB of CUDA
# wheels, while `torch==2.13.0` resolves to a local CPU wheel on the project's machines.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${PDSERVE_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install --quiet --upgrade pip
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing torch==${PDSERVE_TORCH_VERSION:-2.13.0}"
  "$PY" -m pip install --quiet "torch==${PDSERVE_TORCH_VERSION:-2.13.0}"
fi
# Reinstall only when pyproject.toml changed since the last install.
stamp="$VENV/.pdserve-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "[setup] installing pdserve and its dependencies"
  "$PY" -m pip install --quiet -e ".[test]"
  touch "$stamp"
fi
