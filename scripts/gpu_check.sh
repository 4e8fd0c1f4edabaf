#!/usr/bin/env bash
# GPU checks of the Megatron integration (2 GPUs): CP=1 vs CP=2 pretraining per algo, then the GPU tests.
# Needs the megatron-core wheel in .whl/ where the GPU image has no megatron-core (see README).
OUT=${OUT:-results}; mkdir -p "$OUT"
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site; fi
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
M="--num-layers 4 --hidden-size 2048 --num-attention-heads 16 --seq-length 32768 --micro-batch-size 1 --train-iters 10 --bf16 --use-distributed-optimizer --lr 3e-4 --min-lr 3e-5 --log-interval 1"
torchrun --nproc-per-node 1 -m megatron_cp_plugin.pretrain $M --log-json $OUT/cp1.jsonl 2>&1 | grep -E "iter|failed|Error" | tail -4
for a in ring burst attention2d-no attention2d-o; do torchrun --nproc-per-node 2 -m megatron_cp_plugin.pretrain $M --context-parallel-algo $a --log-json $OUT/cp2_$a.jsonl 2>&1 | grep -E "megatron-cp|iter|failed|Error" | tail -3; done
python3 -m pytest -q tests/test_local_attn.py tests/test_gpu.py tests/test_cp_attention.py -x -k "gpu or cuda or cudnn or flash or nccl or 2-ring" 2>&1 | tail -3
