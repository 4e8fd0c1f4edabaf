#!/usr/bin/env bash
# Parity harness: Megatron-LM's pretrain_gpt.py with our patch, every algorithm against CP = 1 (needs GPUs).
#   bash scripts/megatron_lm_check.sh /path/to/Megatron-LM [--cp 2 4] [--pp-run ALGO] [--fsdp-run ALGO] ...
# Same as `megatron-cp-megatron-lm parity`; see docs/megatron_lm.md. Exits 1 past the tolerance, 3 without GPUs.
set -euo pipefail
if [[ $# -lt 1 ]]; then
  echo "usage: $0 MEGATRON_LM_DIR [megatron-cp-megatron-lm parity flags]" >&2
  exit 2
fi
mlm=$(cd "$1" && pwd) || { echo "$0: no directory $1" >&2; exit 2; }
shift
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
exec "${PYTHON:-python3}" -W ignore -m megatron_cp_plugin.megatron_lm.cli parity "$mlm" "$@"
