#!/usr/bin/env bash
# Set up (or reuse) .venv and run the main job on embedded defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/pdserve serve --demo "$@"
