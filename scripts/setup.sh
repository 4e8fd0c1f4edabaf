#!/usr/bin/env bash
# Everything the package, its demo and its tests need, on a fresh machine (idempotent).
# torch: a machine that already has one (the GPU images ship a CUDA build) keeps it; elsewhere the CPU
# machines get the torch 2.13.0 CPU wheel (an unpinned torch would pull a CUDA build of several GB).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$PY" -m pip install -q torch
  else
    "$PY" -m pip install -q torch==2.13.0
  fi
fi
# Triton (DeFT, flash-decode kernels): GPU images get it with their torch; elsewhere the kernels run in Triton's
# CPU interpreter (TRITON_INTERPRET=1) for the tests, so install it where it is missing.
if ! "$PY" -c "import triton" 2>/dev/null; then
  "$PY" -m pip install -q triton==3.6.0
fi
"$PY" -m pip install -q -e ".[test]"
