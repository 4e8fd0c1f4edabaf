#!/usr/bin/env bash
# Issue 15 items 1 and 3 on the GPUs present (about 3 min on 4 x H200; everything stops by $BUDGET s, default 340).
# From the repo root:   OUT=/some/dir bash scripts/gpu_numerics_check.sh
# No megatron-core needed. Logs under $OUT:
#   large_activation.log  one GPU, issue 15's input (v ~ 1500, dO = 0.5; fp16 and bf16): error against fp64
#                         of torch's SDPA per backend, flash-attn, our block kernels from the real O, from the
#                         surrogate O and from an exact D, and every algorithm on a 1-rank group
#   pytest_gpu.log        tests/test_local_attn.py's large-activation GPU test (cuDNN, FA2; fp16, bf16)
#   nccl_P<n>.log         tests/nccl_check.py for each GPU count n in 2, 4, 8 present: every algorithm,
#                         Attention2D on every grid of n, bf16 and fp16 large activations, S = $SEQ
#   summary.txt           one line per step: exit code and seconds
# Exits non-zero if any step fails or is skipped for time.
OUT=${OUT:-results}
SEQ=${SEQ:-32768}; BUDGET=${BUDGET:-340}
source "$(dirname "$0")/gpu_steps.sh"
step large_activation 90 python3 tests/large_activation_check.py
step pytest_gpu 90 python3 -m pytest -q -rs -p no:cacheprovider tests/test_local_attn.py -k large_activations_on_gpu
for n in 2 4 8; do
  [ "$n" -le "$GPUS" ] && step "nccl_P$n" 200 torchrun --nproc-per-node "$n" tests/nccl_check.py --seq "$SEQ"
done
grep -h "FAIL\|all ok\|passed\|failed\|Error" "$OUT"/*.log | tail -30
exit $status
