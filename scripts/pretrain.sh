#!/usr/bin/env bash
# The main job: set up on a fresh machine, then pretrain a tiny GPT on mock data with context-parallel
# attention (attention2d; CP = 4 CPU processes, or every GPU present) and print its loss next to CP = 1's.
# Extra arguments go to megatron-cp-pretrain (e.g. --context-parallel-algo ring --train-iters 50).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/python.sh
NPROC=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 4)")
exec "$PY" -W ignore -m megatron_cp_plugin.pretrain --compare-cp1 --nproc "$NPROC" --mock-data "$@"
