#!/usr/bin/env bash
# Issue 34 on one GPU: the kernels' GPU tests, then one rank's work per algorithm against ring and the ideal
# (bench rank, the issue's rows plus GQA), with the cost model's compute factors fitted from it.
#   OUT=dir bash scripts/gpu_perf_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_merge.py tests/test_surrogate.py \
  tests/test_local_attn.py -k "gpu or GPU or cuda" 2>&1 | tail -4 | tee "$OUT/kernel_tests.log"
timeout "${RANK_LIMIT:-420}" python3 -m megatron_cp_plugin.bench rank --cp 4 16 64 --seq-len 131072 1048576 \
  --heads 32 --kv-heads 32 8 --iters 5 --budget-s 1 --ideal-max-seq 262144 --deadline-s "${RANK_DEADLINE:-330}" \
  --out "$OUT/rank" --fit-out "$OUT/rank_compute.json" 2>&1 | tail -60
