#!/usr/bin/env bash
# The Megatron-facing tests against a megatron-core release CI's Python 3.11 cannot install (0.17-0.19 need
# Python >= 3.12; CI tests 0.16.1): tests/test_megatron.py, test_megatron_lm.py and test_configs.py by default.
#   GPU machine (Python 3.12, torch 2.11, megatron-core 0.19.2's wheel in .whl/):
#     OUT=dir bash scripts/gpu_megatron_core_check.sh [pytest args]
#   a CPU machine with a Python 3.12 (pyenv's here): PY312=/path/to/python3.12 OUT=dir bash scripts/gpu_megatron_core_check.sh
#     makes /tmp/mcp-py312 (a venv: PyPI's torch 2.13.0, the CUDA build, 2.7 GB of wheels, 4.9 GB installed;
#     megatron-core 0.19.2; this package with [test]) once, then reuses it. Measured on CI's kind of 2-core machine
#     (docs/testing.md): 133 s to install, 54 s for the three files.
# TESTS="tests/a.py ..." picks other files. Writes $OUT/megatron_core_check.log and one summary line
# ($OUT/summary.txt: Python, torch, megatron-core versions, counts); exits non-zero on a failure, or when the
# megatron-core found is older than 0.17 (then this would test nothing CI does not).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}; mkdir -p "$OUT"
TESTS=${TESTS:-tests/test_megatron.py tests/test_megatron_lm.py tests/test_configs.py}
if [[ -n ${PY312:-} ]]; then
  venv=${MCP_PY312_VENV:-/tmp/mcp-py312}
  if [[ ! -x $venv/bin/python ]]; then
    "$PY312" -m venv "$venv" || exit 2
  fi
  PY=$venv/bin/python
  # scripts/setup.sh's stamp logic, for this venv: pip only when the package's metadata changed
  key=$(cat pyproject.toml setup.py | sha256sum | cut -d' ' -f1)
  if [[ $(cat "$venv/.mcp-check-stamp" 2>/dev/null) != "$key" ]]; then
    "$PY" -m pip install -q torch==2.13.0 "megatron-core==0.19.2" && "$PY" -m pip install -q -e ".[test]" || exit 2
    echo "$key" > "$venv/.mcp-check-stamp"
  fi
  export PATH=$venv/bin:$PATH
else
  PY=python3
  if [[ -d .whl ]]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
  fi
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
versions=$("$PY" -W ignore -c "
import sys, torch, megatron.core as mc
v = tuple(int(x) for x in mc.__version__.split('.')[:2])
print(f'Python {sys.version.split()[0]}, torch {torch.__version__}, megatron-core {mc.__version__}')
sys.exit(0 if v >= (0, 17) else 3)" 2>/dev/null)
vrc=$?
if [[ $vrc != 0 ]]; then
  echo "megatron_core_check: needs megatron-core >= 0.17 (Python 3.12); found: ${versions:-none}" | tee "$OUT/summary.txt"
  exit 2
fi
start=$SECONDS
# shellcheck disable=SC2086  # TESTS is a list of files
"$PY" -m pytest -q -ra --timeout 600 -p no:cacheprovider $TESTS "$@" > "$OUT/megatron_core_check.log" 2>&1
rc=$?
counts=$(grep -E "[0-9]+ (passed|failed)" "$OUT/megatron_core_check.log" | tail -1)
echo "megatron_core_check: $versions, $((SECONDS - start)) s: ${counts:-no summary} (rc=$rc)" | tee "$OUT/summary.txt"
exit "$rc"
