# shellcheck shell=bash
# Sourced by scripts/{setup,test,pretrain,demo}.sh so that all four use one interpreter, in this order:
#   PYTHON=/path/to/python   that interpreter, as it is (no virtualenv made);
#   VIRTUAL_ENV set          the active virtualenv (`source venv/bin/activate` sets it);
#   otherwise                .venv/ in the checkout, made by scripts/setup.sh with --system-site-packages, so
#                            a torch that the machine already has (a GPU image's CUDA build) is used, not
#                            downloaded again; what setup.sh installs goes into .venv/ only.
# Sets PY and MCP_VENV (empty with PYTHON=), and puts the environment's bin/ first on PATH, so that
# `torchrun` and the megatron-cp-* commands the tests start are that environment's.
_repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -n ${PYTHON:-} ]]; then
  PY=$PYTHON
  MCP_VENV=
elif [[ -n ${VIRTUAL_ENV:-} ]]; then
  MCP_VENV=$VIRTUAL_ENV
  PY=$MCP_VENV/bin/python
else
  MCP_VENV=$_repo/.venv
  PY=$MCP_VENV/bin/python
fi
if [[ -n $MCP_VENV ]]; then
  export PATH=$MCP_VENV/bin:$PATH
fi
unset _repo
