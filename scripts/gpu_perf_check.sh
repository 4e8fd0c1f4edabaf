#!/usr/bin/env bash
# Issue 34 on ONE GPU: one rank's work per algorithm against ring and the ideal (`bench rank`: the issue's rows, MHA
# and GQA; each (length, heads, P) cell's rows timed there and back, `--passes 2`, so that x_ring compares like with
# like), with the cost model's compute factors fitted from it. About 8 minutes; everything stops by $BUDGET s
# (default 590). The fused kernels' GPU tests run in scripts/gpu_tests.sh. From the repo root:
#   OUT=/some/dir bash scripts/gpu_perf_check.sh
# Files under $OUT: rank.log, rank.{json,md,png}, rank_compute.json (the fit), surrogate.{log,json,md} (the surrogate
# kernel's A/B), summary.txt (a line per step).
# Exits non-zero if the step fails or is skipped for time.
# On an H200 the deadline cuts the 1M GQA rows (2026-11-29: all of them; at 1M a row takes 30-60 s). Time them in a
# second call, the slowest-rank search at 128k as in the first (it runs at each problem's first length), then fit
# both runs together:
#   python3 -m megatron_cp_plugin.bench rank --cp 16 64 --seq-len 131072 1048576 --heads 32 --kv-heads 8 --iters 6 \
#     --passes 2 --budget-s 1 --ideal-max-seq 262144 --deadline-s 540 --out $OUT/gqa
#   megatron-cp-bench rank --refit A/rank.json B/gqa.json --fit-out megatron_cp_plugin/configs/rank_compute.json
set -u
export OUT=${OUT:-results}
BUDGET=${BUDGET:-590}
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/*.whl && export PYTHONPATH=/tmp/site; fi
source "$(dirname "$0")/gpu_steps.sh"
# The surrogate O kernel's two selections side by side at the shipped launch (kernels/surrogate.py SELECT, keys since
# the twenty-eighth session's sweep; burst's round call at 128k P = 64 is 524288 rows), ~20 s.
step surrogate 45 python3 -m megatron_cp_plugin.bench surrogate --rows 524288 262144 --select argmax keys --iters 30 \
  --out "$OUT/surrogate"
step rank 580 python3 -m megatron_cp_plugin.bench rank --cp 4 16 64 --seq-len 131072 1048576 --heads 32 \
  --kv-heads 32 8 --iters 6 --passes 2 --budget-s 1 --ideal-max-seq 262144 --deadline-s 500 --out "$OUT/rank" \
  --fit-out "$OUT/rank_compute.json"
cat "$OUT/surrogate.md" "$OUT/rank.md" 2>/dev/null
exit $status
