#!/usr/bin/env bash
# Set up (or reuse) .venv, lint, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${PDSERVE_VENV:-.venv}  # where setup.sh installed
# The registry tests run a real redis-server (never a fake): install it when missing.
if ! command -v redis-server >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server
fi
"$VENV"/bin/ruff check .
"$VENV"/bin/ruff format --check .
# The documentation site: broken links, missing pages or a stale nav fail the build (offline).
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
NO_MKDOCS_2_WARNING=1 "$VENV"/bin/mkdocs build --strict --quiet --site-dir "$site"
# Two workers: the Serve tier and the benchmarks' tests are one unit of work (tests/conftest.py), run
# one at a time by one worker, while the other worker takes the rest.
"$VENV"/bin/python -m pytest -n "${PDSERVE_TEST_WORKERS:-2}" "$@"
