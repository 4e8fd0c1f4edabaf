#!/usr/bin/env bash
# Prefill + 32 decoded tokens on 2 GPUs: a 32-layer GPT with Llama-3.1-8B attention (32 heads, 8 KV heads,
# d = 128; hidden 4096, ffn 14336; random weights that give varying greedy tokens, bf16), tree vs ring
# decoding, the decode step replayed as one CUDA graph per token (DECODE_MODE=eager runs it eagerly). Each run
# reports the prefill time, the per-token latency, tokens/s and the bandwidth floor. scripts/gpu_decode_check.sh
# is the fuller check.
OUT=${OUT:-results}; mkdir -p "$OUT"
if [ -d .whl ] && ! python3 -c "import megatron.core" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
M="--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --num-query-groups 8 --ffn-hidden-size 14336 --bf16 --max-new-tokens ${NEW:-32} --context-parallel-algo ring --decode-mode ${DECODE_MODE:-graph}"
for ctx in ${CONTEXTS:-32768 131072}; do
  python3 -c "import random; random.seed(0); print(''.join(random.choice('abcdefghij ') for _ in range($ctx - 1)))" > /tmp/prompt_$ctx.txt
  for dec in tree ring; do
    torchrun --nproc-per-node 2 -m megatron_cp_plugin.inference.cli $M --decoder $dec --prompt-file /tmp/prompt_$ctx.txt 2>&1 | grep -E "megatron-cp-generate|prefill|per-token|floor|Error" | tee -a $OUT/generate.log
  done
done
