#!/usr/bin/env bash
# Issue 34 on ONE GPU: the fused kernels' GPU tests, then one rank's work per algorithm against ring and the ideal
# (`bench rank`: the issue's rows, MHA and GQA), with the cost model's compute factors fitted from it. About 7
# minutes; everything stops by $BUDGET s (default 540). From the repo root:
#   OUT=/some/dir bash scripts/gpu_perf_check.sh
# Files under $OUT: kernels.log, rank.log, rank.{json,md,png}, rank_compute.json (the fit), summary.txt (a line
# per step). Exits non-zero if any step fails or is skipped for time.
set -u
export OUT=${OUT:-results}
BUDGET=${BUDGET:-540}
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/*.whl && export PYTHONPATH=/tmp/site; fi
source "$(dirname "$0")/gpu_steps.sh"
step kernels 150 python3 -m pytest -q -p no:cacheprovider tests/test_merge.py tests/test_surrogate.py \
  tests/test_local_attn.py -k "gpu or GPU or cuda"
step rank 420 python3 -m megatron_cp_plugin.bench rank --cp 4 16 64 --seq-len 131072 1048576 --heads 32 \
  --kv-heads 32 8 --iters 5 --budget-s 1 --ideal-max-seq 262144 --deadline-s 330 --out "$OUT/rank" \
  --fit-out "$OUT/rank_compute.json"
tail -3 "$OUT/kernels.log"; cat "$OUT/rank.md" 2>/dev/null
exit $status
