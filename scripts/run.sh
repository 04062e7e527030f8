#!/usr/bin/env bash
# Set up (or reuse) .venv and run the main job on embedded defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${PDSERVE_VENV:-.venv}  # where setup.sh installed
exec "$VENV"/bin/pdserve serve --demo "$@"
