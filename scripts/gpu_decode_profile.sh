#!/usr/bin/env bash
# Issue 36 item 1: where the time of one CUDA-graphed decode step goes, per kernel, against the bytes each part
# must read (bench/decode_profile.py; docs/decode.md, "Where a step's time goes"). The 32-layer GPTModel of
# `megatron-cp-bench decode --model` (Llama-3.1-8B shape: hidden 4096, 32 heads, 8 KV heads, ffn 14336 not
# gated, vocabulary 257, random bf16 weights), batch 1, tree decoding, the cache filled with random K, V:
#   A. CP = 1 on one GPU, 32k and 128k, graphed; beside it the single-GPU anchor, torch's SDPA over the cache
#      (--decoders sdpa);
#   B. CP = 2 under torchrun --nproc-per-node 2 (NCCL, one GPU each), 128k, graphed; needs 2 GPUs (with one, B is
#      reported skipped and the script exits non-zero).
# Each configuration: 3 warm-up steps (the first captures the graph) and $STEPS (default 10) steps under
# torch.profiler; every kernel in one part (gemm, attention, rope_append, norm, exchange, merge, sampling, copy,
# other), busy (their union), idle (wall - busy), wall; us per step, kernels, share of the wall, bytes the part
# must read, GB/s and the fraction of the floor's bandwidth (H200 4.3 TB/s, H100 3.0).
# Not yet run; expected 2-3 minutes on 2 GPUs (mostly start-up: megatron-core import, 10 GB of weights, Triton
# compiles). Every step has a timeout and the whole run stops by $BUDGET s (default 300).
# Writes under $OUT: norm.{json,md} (megatron-cp-bench norm), bias_add.{json,md}, gemv.{json,md}, N.log, BA.log, G.log, A.log, B.log, profile_cp1.{json,md}, profile_cp2.{json,md}, profile_cp{1,2}_traces/*.json.gz
# (one Chrome trace per configuration and rank, for Perfetto), summary.txt (one line per step), summary.md (the
# parts of each configuration's step, rank by rank). Exits non-zero if a step fails or is skipped, or a
# configuration did not run.
set -u
export OUT=${OUT:-results/decode_profile}; mkdir -p "$OUT"
if [ -d .whl ] && ! python3 -c "import megatron.core" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
BUDGET=${BUDGET:-300}                     # seconds for everything; a step gets what is left, capped
STEPS=${STEPS:-10}
source "$(dirname "$0")/gpu_steps.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$OUT/summary.txt" 2>&1
# PDL=both (default): each graphed configuration also without programmatic dependent launch ('graph-nopdl'), whose
# per-part times are the ones to read: with PDL a kernel starts before the one ahead of it ends, so part times
# overlap and only busy, idle and wall add up.
P="-m megatron_cp_plugin.bench.decode --model --profile --profile-steps $STEPS --batch 1 --eager-context --pdl ${PDL:-both}"

step N 60 python3 -m megatron_cp_plugin.bench norm --out "$OUT/norm"     # the fused norm against torch's
step BA 60 python3 -m megatron_cp_plugin.bench bias-add --out "$OUT/bias_add"   # the fused bias + residual add
step G 90 python3 -m megatron_cp_plugin.bench gemv --out "$OUT/gemv"           # the fused linears against cuBLAS
step A 150 torchrun --nproc-per-node 1 $P --decoders tree sdpa --context 32768 131072 --out "$OUT/profile_cp1"
if [ "$GPUS" -ge 2 ]; then
  step B 150 torchrun --nproc-per-node 2 $P --decoders tree --context 131072 --out "$OUT/profile_cp2"
else
  echo "B: skipped, CP = 2 needs 2 GPUs ($GPUS here)" | tee -a "$OUT/summary.txt"; status=1
fi

python3 - "$OUT" <<'EOF' | tee "$OUT/summary.md"
import json, os, sys
out = sys.argv[1]
failed = False
print("# Issue 36 item 1: decode step profile (scripts/gpu_decode_profile.sh)\n")
for cp in (1, 2):
    try:
        with open(os.path.join(out, f"profile_cp{cp}.json")) as f:
            res = json.load(f)
    except (OSError, ValueError):
        failed = True
        print(f"CP = {cp}: no profile_cp{cp}.json (see {'A' if cp == 1 else 'B'}.log)\n")
        continue
    print(f"## CP = {cp}, {res['device']}\n\n{res['header']}\n")
    keys = []
    for r in res["rows"]:
        if "not_run" in r or "error" in r:
            failed = True
            print(f"{r['context']} b={r['batch']} {r['decoder']} {r['mode']}: {r.get('not_run') or r.get('error')}\n")
        elif (r["context"], r["decoder"], r["mode"], r["rank"]) not in keys:
            keys.append((r["context"], r["decoder"], r["mode"], r["rank"]))
    for key in keys:
        n, dec, mode, rank = key
        rows = {r["part"]: r for r in res["rows"] if "part" in r and (r["context"], r["decoder"], r["mode"], r["rank"]) == key}
        w = rows["wall"]
        floor = "" if w["of_bw"] == "" else f" = {1 / w['of_bw']:.2f}x the floor"
        how = f"tree ({w['variant']})" if dec == "tree" else "torch SDPA over the cache (anchor)" if dec == "sdpa" else dec
        print(f"### {n // 1024}k, batch 1, {how}, {mode}, rank {rank}: wall {w['us'] / 1e3:.2f} ms"
              f"{floor} (CUDA events {w['events_ms']:.2f} ms; the floor reads {w['must_read_MB']:.0f} MB)\n")
        print("| part | us | kernels | share | must read MB | GB/s | of bw |\n|---|---|---|---|---|---|---|")
        for part, r in rows.items():
            f = lambda v, fmt: "" if v == "" else format(v, fmt)
            print(f"| {part} | {r['us']} | {r['n']:g} | {r['share']:.3f} | {f(r['must_read_MB'], '.3g')} | "
                  f"{f(r['GBps'], '.0f')} | {f(r['of_bw'], '.2f')} |")
        if abs(rows["busy"]["us"] + rows["idle"]["us"] - w["us"]) > 1:
            failed = True
            print("\nFAIL: busy + idle != wall")
        if rows["other"]["share"] > 0.1:
            print(f"\nnote: {rows['other']['share']:.0%} of the step is 'other' (kernels the table does not name): "
                  "see the trace under profile_cp*_traces/")
        print()
sys.exit(1 if failed else 0)
EOF
[ "${PIPESTATUS[0]}" = 0 ] || status=1
echo "done in ${SECONDS} s; results in $OUT (summary.txt, summary.md)"
exit $status
