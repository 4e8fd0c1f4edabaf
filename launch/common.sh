# shellcheck shell=bash disable=SC2034  # PY, RUN_NAME, RESULT_JSON are for the script that sources this
# Sourced by launch/run.sh (SLURM) and launch/local.sh (one machine): the environment -> pretrain flags.
# Sets REPO, PY (interpreter), RUN_NAME, RESULT_JSON and the array PRETRAIN_ARGS; needs NNODES, NPROC_PER_NODE.
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
