# shellcheck shell=bash disable=SC2034  # PY, RUN_NAME, RESULT_JSON are for the script that sources this
# Sourced by launch/run.sh (SLURM) and launch/local.sh (one machine): the environment -> the training command.
# Sets REPO, PY (interpreter), RUN_NAME, RESULT_JSON and PRETRAIN_ARGS; prepare_run then sets PLAN_LINE, TRAIN_CWD
# (where the ranks start) and the array TRAIN_CMD (what follows `torchrun ...`); needs NNODES, NPROC_PER_NODE.
#   TRAINER     megatron-cp-pretrain (default; also: plugin); megatron-lm: Megatron-LM's pretrain_gpt.py in
#               $MEGATRON_LM (patched here when it is not yet: megatron-cp-megatron-lm patch), with the same
#               configs turned into its flags by megatron_cp_plugin.megatron_lm.flags
#   MEGATRON_LM a Megatron-LM checkout (TRAINER=megatron-lm)
#   LAYOUT      auto (default): the memory planner's first layout that fits the job's GPUs (either trainer);
#               config: what the configs say; or a planner layout: zero1, fsdp-optim_grads, fsdp-optim_grads_params,
#               ppN-zero1 (Megatron-LM), each optionally +recompute. The run starts only if it fits
#   GPU_MEM     GiB per GPU to plan for (default: what the smallest GPU here gives CUDA, else 79.1); PLAN_FORCE=1 starts a run the
#               planner says does not fit
#   DRY_RUN     1: print the plan line and the command and exit (no srun, no torchrun, no patch)
#   CONFIG      config files, space-separated, later ones override earlier (default configs/tiny.toml)
#   ALGO        --context-parallel-algo (default attention2d-no)
#   SEQ         --seq-length (default: the config's)
#   EXTRA_ARGS  more megatron-cp-pretrain flags; they override the config files (word-split, no quoting)
#   RESULT_DIR  where RUN_NAME.json (--result-json) goes (default results); RUN_NAME: a name from the above
#   VENV        a virtualenv to use (its python); PYTHON: the interpreter otherwise (default python3)

REPO=${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
CONFIG=${CONFIG:-configs/tiny.toml}
ALGO=${ALGO:-attention2d-no}
RESULT_DIR=${RESULT_DIR:-results}
if [[ -n ${VENV:-} ]]; then PY=$VENV/bin/python; else PY=${PYTHON:-python3}; fi

read -r -a _configs <<<"$CONFIG"
read -r -a _extra <<<"${EXTRA_ARGS:-}"
_stem=$(basename "${_configs[0]}" .toml)
RUN_NAME=${RUN_NAME:-${_stem}_${ALGO}_s${SEQ:-cfg}_${NNODES}x${NPROC_PER_NODE}${SLURM_JOB_ID:+_j$SLURM_JOB_ID}}
case $RESULT_DIR in /*) ;; *) RESULT_DIR=$REPO/$RESULT_DIR ;; esac   # ranks start in $REPO, the user may not
RESULT_JSON=$RESULT_DIR/$RUN_NAME.json
mkdir -p "$RESULT_DIR"

PRETRAIN_ARGS=(--config "${_configs[@]}" --context-parallel-algo "$ALGO" --result-json "$RESULT_JSON")
[[ -n ${SEQ:-} ]] && PRETRAIN_ARGS+=(--seq-length "$SEQ")
# Attention2D keeps grid rows inside a node when it knows the node size (ring and burst ignore it)
PRETRAIN_ARGS+=(--cp-gpus-per-node "$NPROC_PER_NODE")
PRETRAIN_ARGS+=("${_extra[@]}")

TRAINER=${TRAINER:-megatron-cp-pretrain}
case $TRAINER in
  plugin | megatron-cp-pretrain) ;;
  megatron-lm)
    if [[ -z ${MEGATRON_LM:-} || ! -f ${MEGATRON_LM:-}/pretrain_gpt.py ]]; then
      echo "launch: TRAINER=megatron-lm needs MEGATRON_LM=<a Megatron-LM checkout with pretrain_gpt.py>" >&2
      exit 2
    fi ;;
  *)
    echo "launch: TRAINER must be megatron-cp-pretrain (or plugin) or megatron-lm, got '$TRAINER'" >&2
    exit 2 ;;
esac

# prepare_run [PREFIX...]: launch/prepare.sh (plan, flag translation, patch) through PREFIX (e.g. srun into the
# container; nothing: here, with $PY). Its settings go on its command line, so they cross srun and the container.
prepare_run() {
  local out
  out=$("$@" env REPO="$REPO" PY="$PY" TRAINER="$TRAINER" MEGATRON_LM="${MEGATRON_LM:-}" LAYOUT="${LAYOUT:-auto}" \
        GPU_MEM="${GPU_MEM:-}" PLAN_FORCE="${PLAN_FORCE:-0}" DRY_RUN="${DRY_RUN:-0}" \
        WORLD=$((NNODES * NPROC_PER_NODE)) bash "$REPO/launch/prepare.sh" "${PRETRAIN_ARGS[@]}") || exit $?
  local lines
  mapfile -t lines <<<"$out"
  PLAN_LINE=${lines[0]}
  TRAIN_CWD=${lines[1]}
  TRAIN_CMD=("${lines[@]:2}")
  if [[ $TRAINER == megatron-lm ]]; then
    # Megatron-LM wants one CUDA connection for TP/CP overlap on Hopper, and none set with Megatron-FSDP
    if printf '%s\n' "${TRAIN_CMD[@]}" | grep -qx -- --use-megatron-fsdp; then
      unset CUDA_DEVICE_MAX_CONNECTIONS
    else
      export CUDA_DEVICE_MAX_CONNECTIONS=1
    fi
    export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
  fi
}
