#!/usr/bin/env bash
# Set up on a fresh machine, then run the whole test suite (GPU tests skip, with a message, without GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/python.sh                  # setup.sh's interpreter, its bin/ first on PATH
exec "$PY" -m pytest -q --timeout 900 tests "$@"
