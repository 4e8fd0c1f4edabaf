#!/usr/bin/env bash
# Set up on a fresh machine, then run the demo: every algorithm on a sharded random sequence, errors and times.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/python.sh
exec "$PY" -m megatron_cp_plugin.demo "$@"
