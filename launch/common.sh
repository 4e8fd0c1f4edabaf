# shellcheck shell=bash disable=SC2034  # PY, RUN_NAME, RESULT_JSON are for the script that sources this
# Sourced by launch/run.sh (SLURM) and launch/local.sh (one machine): the environment -> the training command.
# Sets REPO, PY (interpreter), RUN_NAME, RESULT_JSON, TRAIN_CWD (where the ranks start) and the array TRAIN_CMD
# (what follows `torchrun ...`); needs NNODES, NPROC_PER_NODE.
#   TRAINER     plugin (default): megatron-cp-pretrain; megatron-lm: Megatron-LM's pretrain_gpt.py in
#               $MEGATRON_LM (patched here when it is not yet: megatron-cp-megatron-lm patch), with the same
#               configs turned into its flags by megatron_cp_plugin.megatron_lm.flags
#   MEGATRON_LM a Megatron-LM checkout (TRAINER=megatron-lm); LAYOUT: auto (default), zero1 or fsdp
#   DRY_RUN     1: print the command and exit (no srun, no torchrun)
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

TRAINER=${TRAINER:-plugin}
case $TRAINER in
  plugin)
    TRAIN_CWD=$REPO
    TRAIN_CMD=(-m megatron_cp_plugin.pretrain "${PRETRAIN_ARGS[@]}") ;;
  megatron-lm)
    if [[ -z ${MEGATRON_LM:-} || ! -f ${MEGATRON_LM:-}/pretrain_gpt.py ]]; then
      echo "launch: TRAINER=megatron-lm needs MEGATRON_LM=<a Megatron-LM checkout with pretrain_gpt.py>" >&2
      exit 2
    fi
    # --result-json is the plugin trainer's; Megatron-LM logs the per-iteration loss itself
    _lm_args=()
    for ((i = 0; i < ${#PRETRAIN_ARGS[@]}; i++)); do
      if [[ ${PRETRAIN_ARGS[i]} == --result-json ]]; then ((i++)) || true; else _lm_args+=("${PRETRAIN_ARGS[i]}"); fi
    done
    _flags=$(cd "$REPO" && "$PY" -W ignore -m megatron_cp_plugin.megatron_lm.flags \
      --world-size $((NNODES * NPROC_PER_NODE)) --layout "${LAYOUT:-auto}" "${_lm_args[@]}") || exit 2
    mapfile -t _lm_flags <<<"$_flags"
    if [[ ${DRY_RUN:-0} != 1 ]]; then
      (cd "$REPO" && "$PY" -W ignore -m megatron_cp_plugin.megatron_lm.cli patch "$MEGATRON_LM") || exit 2
    fi
    TRAIN_CWD=$MEGATRON_LM
    TRAIN_CMD=(pretrain_gpt.py "${_lm_flags[@]}")
    # Megatron-LM wants one CUDA connection for TP/CP overlap on Hopper, and none set with Megatron-FSDP
    if printf '%s\n' "${_lm_flags[@]}" | grep -qx -- --use-megatron-fsdp; then
      unset CUDA_DEVICE_MAX_CONNECTIONS
    else
      export CUDA_DEVICE_MAX_CONNECTIONS=1
    fi
    export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} ;;
  *)
    echo "launch: TRAINER must be plugin or megatron-lm, got '$TRAINER'" >&2
    exit 2 ;;
esac
