#!/usr/bin/env bash
# One training run on this machine, no SLURM: torchrun --standalone with NPROC_PER_NODE ranks (default: the
# GPUs here, else 4 CPU processes over gloo), every rank in context parallelism. The same environment as
# launch/run.sh (CONFIG ALGO SEQ EXTRA_ARGS RESULT_DIR RUN_NAME VENV PYTHON; see launch/common.sh), e.g.
#   CONFIG="configs/tiny.toml" ALGO=ring NPROC_PER_NODE=4 bash launch/local.sh
set -euo pipefail
# shellcheck disable=SC2034  # read by common.sh
NNODES=1
if [[ -z ${NPROC_PER_NODE:-} ]]; then
  NPROC_PER_NODE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [[ ${NPROC_PER_NODE:-0} -gt 0 ]] || NPROC_PER_NODE=4
fi
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
prepare_run                                  # the plan (refuses what does not fit), flags, patch: here
cd "$TRAIN_CWD"
echo "launch/local.sh: $NPROC_PER_NODE ranks, $ALGO, $TRAINER trainer, result $RESULT_JSON"
echo "$PLAN_LINE"
cmd=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC_PER_NODE" "${TRAIN_CMD[@]}")
if [[ ${DRY_RUN:-0} == 1 ]]; then printf '%q ' "${cmd[@]}"; echo; exit 0; fi
exec "${cmd[@]}"
