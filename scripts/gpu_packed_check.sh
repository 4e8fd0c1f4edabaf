#!/usr/bin/env bash
# Issue 18 on 2 GPUs (H200): packed sequences (THD, cu_seqlens) under every algorithm, NCCL, bf16; and the
# packed benchmark (128k tokens of lognormal documents, mean 4k, P = 2). About 4 minutes; everything stops by
# $BUDGET s (default 340). From the repo root:   OUT=/some/dir bash scripts/gpu_packed_check.sh
# megatron-core (the .whl/ wheels on PYTHONPATH) enables the tiny-GPT step; without it that step is skipped.
# Files under $OUT:
#   pytest_gpu.log      tests/test_packed.py's GPU test: fused varlen kernels (FA2-in-torch, flash-attn when
#                       installed) against fp64, every mask, MHA and GQA, empty and one-row documents
#   packed_nccl.log     tests/packed_nccl_check.py at P = 2: every algorithm, Attention2D on both grids, bf16,
#                       causal and not, MHA and GQA, against fp64 (2x single-GPU varlen) and the single-GPU
#                       backward of our own O; with megatron-core, a tiny bf16 GPT's packed loss vs its
#                       documents run alone
#   nccl_unpacked.log   tests/nccl_check.py at P = 2, S = 8192, bf16: the unpacked paths the packing work touched
#   bench.log           megatron-cp-bench packed, and packed_128k.{json,md} (.png with matplotlib): fwd and
#                       fwd+bwd of every algorithm, packed and unpacked, vs single-GPU varlen and dense attention
#   summary.txt         one line per step: exit code and seconds
# Exits non-zero if any step fails or is skipped for time.
OUT=${OUT:-results}
BUDGET=${BUDGET:-340}; TOKENS=${TOKENS:-131072}
source "$(dirname "$0")/gpu_steps.sh"
if [ "$GPUS" -lt 2 ]; then echo "needs 2 GPUs, found $GPUS" | tee -a "$OUT/summary.txt"; exit 1; fi
MEGATRON=""
python3 -c "import megatron.core" > /dev/null 2>&1 && MEGATRON="--megatron"
[ -z "$MEGATRON" ] && echo "megatron-core not importable: the tiny-GPT step is skipped" | tee -a "$OUT/summary.txt"
step pytest_gpu 80 python3 -m pytest -q -rs -p no:cacheprovider tests/test_packed.py -k gpu
step packed_nccl 110 torchrun --nproc-per-node 2 tests/packed_nccl_check.py --tokens 32768 --mean-doc 1024 $MEGATRON
step nccl_unpacked 60 torchrun --nproc-per-node 2 tests/nccl_check.py --seq 8192 --cases bf16
step bench 200 torchrun --nproc-per-node 2 -m megatron_cp_plugin.bench packed --tokens "$TOKENS" --mean-doc 4096 \
  --out "$OUT/packed_128k"
grep -h "FAIL\|all ok\|passed\|failed\|Error" "$OUT"/*.log | tail -30
[ -f "$OUT/packed_128k.md" ] && cat "$OUT/packed_128k.md"
exit $status
