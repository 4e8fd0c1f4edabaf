#!/usr/bin/env bash
# One training run inside a SLURM allocation (launch/scaling.sbatch calls it): one torchrun per node through
# srun, every rank in context parallelism. Settings come from the environment (see launch/common.sh for
# CONFIG ALGO SEQ EXTRA_ARGS RESULT_DIR RUN_NAME VENV PYTHON), and:
#   NPROC_PER_NODE    ranks per node (default: the job's GPUs per node, else the node's GPUs, else 1)
#   CONTAINER         a container image for srun --container-image (pyxis/enroot) instead of VENV/PYTHON;
#   CONTAINER_MOUNTS  more --container-mounts (the checkout is always mounted at the same path)
#   MASTER_PORT       rendezvous port on the first node (default: from the job id, so jobs sharing a node differ)
#   SRUN_ARGS         more srun flags (e.g. --cpu-bind=none, --network=...)
#   TRAINER, MEGATRON_LM, LAYOUT  which trainer (launch/common.sh): plugin (default) or megatron-lm
#   DRY_RUN=1         print the srun command and exit (also outside an allocation: NNODES, NPROC_PER_NODE)
# The job's exit code is srun's: non-zero if any rank fails (--kill-on-bad-exit ends the others).
set -euo pipefail
if [[ ${DRY_RUN:-0} == 1 && -z ${SLURM_JOB_ID:-} ]]; then
  SLURM_JOB_ID=0 SLURM_JOB_NUM_NODES=${NNODES:-1} SLURM_JOB_NODELIST=node0 MASTER_ADDR=${MASTER_ADDR:-node0}
fi
if [[ -z ${SLURM_JOB_ID:-} ]]; then
  echo "launch/run.sh: not inside a SLURM allocation (sbatch launch/scaling.sbatch, or launch/local.sh)" >&2
  exit 2
fi
NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
if [[ -z ${NPROC_PER_NODE:-} ]]; then
  NPROC_PER_NODE=${SLURM_GPUS_ON_NODE:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
  [[ ${NPROC_PER_NODE:-0} -gt 0 ]] || NPROC_PER_NODE=1
fi
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# node 0 runs global rank 0
MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)}
MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}

launcher=()
if [[ -n ${CONTAINER:-} ]]; then
  launcher=(--container-image="$CONTAINER" --container-mounts="$REPO:$REPO${CONTAINER_MOUNTS:+,$CONTAINER_MOUNTS}"
            --container-workdir="$REPO")
  PY=${PYTHON:-python3}                                   # the container's interpreter
fi
read -r -a srun_extra <<<"${SRUN_ARGS:-}"
# GPUs of an --exclusive job are not handed to its steps unless asked for
gpus=()
[[ ${SLURM_GPUS_ON_NODE:-0} -gt 0 ]] && gpus=(--gpus-per-node="$SLURM_GPUS_ON_NODE")

# $SLURM_NODEID is escaped: each srun task (one per node) expands its own, as its torchrun node rank
cmd="cd $(printf %q "$TRAIN_CWD") && exec $(printf %q "$PY") -m torch.distributed.run --nnodes $NNODES \
--nproc-per-node $NPROC_PER_NODE --node-rank \$SLURM_NODEID --master-addr $MASTER_ADDR --master-port $MASTER_PORT \
$(printf '%q ' "${TRAIN_CMD[@]}")"

echo "launch/run.sh: job $SLURM_JOB_ID, $NNODES nodes x $NPROC_PER_NODE ranks, $ALGO, $TRAINER trainer, master $MASTER_ADDR:$MASTER_PORT"
echo "launch/run.sh: result $RESULT_JSON"
echo "launch/run.sh: $cmd"
[[ ${DRY_RUN:-0} == 1 ]] && exit 0
exec srun --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_ON_NODE:-1}" \
  --kill-on-bad-exit=1 "${gpus[@]}" "${launcher[@]}" "${srun_extra[@]}" bash -c "$cmd"
