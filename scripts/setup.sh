#!/usr/bin/env bash
# Everything the package, its demo and its tests need, on a fresh machine, in one environment (scripts/python.sh:
# PYTHON=, else the active virtualenv, else .venv/ in the checkout, made here). Runs pip only when something
# changed since the last successful run: a stamp in the environment holds a hash of pyproject.toml, setup.py,
# the interpreter, this checkout's path and the installed torch, triton, megatron-core and plugin versions.
# torch: an environment that already sees one (a GPU image's CUDA build, through --system-site-packages) keeps
# it; with a GPU, pip's default torch (the CUDA build, about 3 GB with its NVIDIA wheels); without one,
# torch==2.13.0, the CPU build where pip finds it (PIP_FIND_LINKS / a local wheel, or
# PIP_INDEX_URL=https://download.pytorch.org/whl/cpu); an unpinned torch from PyPI is the CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python.sh
if [[ -n $MCP_VENV && ! -x $PY ]]; then
  base=${MCP_BASE_PYTHON:-python3}
  "$base" -m venv --system-site-packages "$MCP_VENV" || {
    echo "setup.sh: '$base -m venv' failed (Debian/Ubuntu: apt-get install python3-venv); or set PYTHON=python3" \
         "to install into that interpreter instead" >&2
    exit 2
  }
fi

# The stamp's key. Versions come from package metadata (no import of torch); "missing" when not installed,
# so a package removed since the last run makes the key differ.
key() {
  "$PY" - <<'EOF'
import hashlib, importlib.metadata as md, importlib.util, pathlib, sys
h = hashlib.sha256()
for f in ("pyproject.toml", "setup.py"):
    h.update(pathlib.Path(f).read_bytes())
spec = importlib.util.find_spec("megatron_cp_plugin")       # the editable install must point at this checkout
parts = [sys.version, sys.executable, str(pathlib.Path.cwd()), str(spec and spec.origin)]
for dist in ("torch", "triton", "megatron-core", "megatron-cp-plugin"):
    try:
        parts.append(f"{dist}={md.version(dist)}")
    except md.PackageNotFoundError:
        parts.append(f"{dist}=missing")
h.update("\n".join(parts).encode())
print(h.hexdigest())
EOF
}
prefix=$("$PY" -c "import sys; print(sys.prefix)")
stamp=$prefix/.megatron-cp-plugin-setup
# PYTHONPATH would let find_spec see a checkout that is not installed
if [[ -f $stamp && $(PYTHONPATH= key) == "$(cat "$stamp")" ]]; then
  exit 0
fi

if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup.sh: installing torch's CUDA build from PyPI (pip downloads about 3 GB with its NVIDIA wheels)" >&2
    "$PY" -m pip install -q torch
  elif "$PY" -m pip install -q --dry-run --no-index --no-deps torch==2.13.0 >/dev/null 2>&1; then
    # a torch 2.13.0 wheel on this machine (pip's find-links): CI's CPU machines have the CPU build there
    "$PY" -m pip install -q torch==2.13.0
  else
    # PyTorch's CPU index: torch 2.13.0+cpu (about 190 MB) sorts above PyPI's 2.13.0 (the CUDA build)
    echo "setup.sh: no GPU: installing torch's CPU build from https://download.pytorch.org/whl/cpu" >&2
    "$PY" -m pip install -q torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu
  fi
  "$PY" -c "import torch; c = torch.version.cuda; print('setup.sh: torch', torch.__version__, \
    f'(CUDA {c} build)' if c else '(CPU build)')" >&2
fi
# Triton (DeFT, flash-decode kernels): GPU images get it with their torch; elsewhere the kernels run in Triton's
# CPU interpreter (TRITON_INTERPRET=1) for the tests, so install it where it is missing.
if ! "$PY" -c "import triton" 2>/dev/null; then
  "$PY" -m pip install -q triton==3.6.0
fi
"$PY" -m pip install -q -e ".[test]"
# No stamp where the environment is not ours to write (PYTHON=/usr/bin/python3 as a user): pip runs each time.
PYTHONPATH= key > "$stamp" 2>/dev/null || true
