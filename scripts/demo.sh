#!/usr/bin/env bash
# Set up on a fresh machine, then run the demo: every algorithm on a sharded random sequence, errors and times.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m megatron_cp_plugin.demo "$@"
