#!/usr/bin/env bash
# Every step before the ranks start, run where they will run (launch/common.sh calls it on this machine, or
# with CONTAINER=... through one srun into the container, so that the container's Python does all of it):
#   1. the memory plan for the job's GPUs (megatron_cp_plugin.bench.launch_plan): picks the layout when LAYOUT
#      is auto, refuses (exit 3, one line) when nothing fits unless PLAN_FORCE=1;
#   2. TRAINER=megatron-lm: the configs -> pretrain_gpt.py flags (megatron_lm/flags.py, in the same process);
#   3. TRAINER=megatron-lm, not DRY_RUN: patch the checkout (megatron-cp-megatron-lm patch; idempotent).
# Environment: REPO PY TRAINER MEGATRON_LM LAYOUT GPU_MEM PLAN_FORCE DRY_RUN WORLD; arguments: the
# megatron-cp-pretrain flags. Prints: the plan line, the directory the ranks start in, then the arguments that
# follow `python -m torch.distributed.run ...`, one per line.
set -euo pipefail
cd "$REPO"
if [[ -z ${GPU_MEM:-} ]]; then
  # what the smallest GPU here gives CUDA (devices.gpu_capacity_gib: nvidia-smi's total less the driver's reserved
  # memory, as megatron-cp-pretrain's own check reads it); where there is none (a dry run on a login node) what an
  # 80 GB GPU gives CUDA (cost/memory.REPORTED_GIB: 79.1), and the line says so
  GPU_MEM=$("$PY" -c "from megatron_cp_plugin.devices import gpu_capacity_gib as c; g = c()
print('' if g is None else f'{g:.1f}')" 2>/dev/null || true)
  if [[ -z $GPU_MEM ]]; then
    GPU_MEM=79.1
    echo "launch: no GPU visible here: planning for 80 GB GPUs, 79.1 GiB to CUDA (set GPU_MEM=<GiB> for others)" >&2
  fi
fi
if [[ ! $GPU_MEM =~ ^[0-9]+([.][0-9]+)?$ ]]; then
  echo "launch: GPU_MEM must be the GiB of one GPU (e.g. 80), got '$GPU_MEM'" >&2
  exit 2
fi
force=()
[[ ${PLAN_FORCE:-0} == 1 ]] && force=(--force)
trainer=plugin
[[ $TRAINER == megatron-lm ]] && trainer=megatron-lm
out=$("$PY" -W ignore -m megatron_cp_plugin.bench.launch_plan --trainer "$trainer" --layout "${LAYOUT:-auto}" \
  --gpus "$WORLD" --gpu-mem "$GPU_MEM" "${force[@]}" -- "$@")
mapfile -t lines <<<"$out"
echo "${lines[0]}"                                   # plan: X GiB per GPU of Y GiB (layout)
if [[ $trainer == megatron-lm ]]; then
  if [[ ${DRY_RUN:-0} != 1 ]]; then
    "$PY" -W ignore -m megatron_cp_plugin.megatron_lm.cli patch "$MEGATRON_LM" >&2
  fi
  echo "$MEGATRON_LM"
  echo pretrain_gpt.py
else
  echo "$REPO"
  printf '%s\n' -m megatron_cp_plugin.pretrain
fi
printf '%s\n' "${lines[@]:1}"
