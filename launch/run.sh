#!/usr/bin/env bash
# One training run inside a SLURM allocation (launch/scaling.sbatch calls it): one torchrun per node through
# srun, every rank in context parallelism. Settings come from the environment (see launch/common.sh for
# CONFIG ALGO SEQ EXTRA_ARGS RESULT_DIR RUN_NAME VENV PYTHON), and:
#   NPROC_PER_NODE    ranks per node (default: the job's GPUs per node, else the node's GPUs, else 1)
#   CONTAINER         a container image for srun --container-image (pyxis/enroot) instead of VENV/PYTHON: the plan,
#                     flag translation and patch run in it too (one srun step on the first node), with its
#                     python3 (or PYTHON); the checkout and MEGATRON_LM are mounted at their own paths
#   CONTAINER_MOUNTS  more --container-mounts (the checkout is always mounted at the same path)
#   MASTER_PORT       rendezvous port on the first node (default: from the job id, so jobs sharing a node differ)
#   SRUN_ARGS         more srun flags (e.g. --cpu-bind=none, --network=...)
#   TRAINER, MEGATRON_LM  which trainer (launch/common.sh): megatron-cp-pretrain (default) or megatron-lm
#   LAYOUT, GPU_MEM, PLAN_FORCE  the memory plan (launch/common.sh): printed as `plan: X GiB per GPU of Y GiB
#                     (layout)` before anything starts; a run that does not fit is not started (exit 3)
#   DRY_RUN=1         print the plan and the srun command and exit (also outside an allocation: NNODES,
#                     NPROC_PER_NODE); with CONTAINER inside an allocation the plan still runs in the container
# The job's exit code is srun's: non-zero if any rank fails (--kill-on-bad-exit ends the others).
set -euo pipefail
_outside_allocation=0
if [[ ${DRY_RUN:-0} == 1 && -z ${SLURM_JOB_ID:-} ]]; then
  _outside_allocation=1
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

read -r -a srun_extra <<<"${SRUN_ARGS:-}"
# GPUs of an --exclusive job are not handed to its steps unless asked for
gpus=()
[[ ${SLURM_GPUS_ON_NODE:-0} -gt 0 ]] && gpus=(--gpus-per-node="$SLURM_GPUS_ON_NODE")
launcher=()
prep=()                                                   # how launch/prepare.sh is run: here
if [[ -n ${CONTAINER:-} ]]; then
  mounts="$REPO:$REPO${MEGATRON_LM:+,$MEGATRON_LM:$MEGATRON_LM}${CONTAINER_MOUNTS:+,$CONTAINER_MOUNTS}"
  launcher=(--container-image="$CONTAINER" --container-mounts="$mounts" --container-workdir="$REPO")
  PY=${PYTHON:-python3}                                   # the container's interpreter
  if [[ $_outside_allocation == 1 ]]; then
    # a dry run on a login node: srun would ask for a new allocation, so the plan comes from this host's Python
    echo "launch/run.sh: dry run outside an allocation: plan and flags from this host's $PY, not the container's" >&2
  else
    # one step on the first node, in the container, for the plan, the flags and the patch
    prep=(srun --nodes=1 --ntasks=1 "${gpus[@]}" "${launcher[@]}" "${srun_extra[@]}")
  fi
fi
prepare_run "${prep[@]}"

# $SLURM_NODEID is escaped: each srun task (one per node) expands its own, as its torchrun node rank
cmd="cd $(printf %q "$TRAIN_CWD") && exec $(printf %q "$PY") -m torch.distributed.run --nnodes $NNODES \
--nproc-per-node $NPROC_PER_NODE --node-rank \$SLURM_NODEID --master-addr $MASTER_ADDR --master-port $MASTER_PORT \
$(printf '%q ' "${TRAIN_CMD[@]}")"

echo "launch/run.sh: job $SLURM_JOB_ID, $NNODES nodes x $NPROC_PER_NODE ranks, $ALGO, $TRAINER trainer, master $MASTER_ADDR:$MASTER_PORT"
echo "launch/run.sh: result $RESULT_JSON"
echo "$PLAN_LINE"
echo "launch/run.sh: $cmd"
[[ ${DRY_RUN:-0} == 1 ]] && exit 0
exec srun --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_ON_NODE:-1}" \
  --kill-on-bad-exit=1 "${gpus[@]}" "${launcher[@]}" "${srun_extra[@]}" bash -c "$cmd"
