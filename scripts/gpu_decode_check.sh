#!/usr/bin/env bash
# Issue 17 on 2 x H200 (about 4-5 minutes; every step has a timeout and the whole run stops by $BUDGET s, default
# 395): the CUDA-graphed decode step of a 32-layer GPTModel (Llama-3.1-8B shape: hidden 4096, 32 heads, 8 KV
# heads, ffn 14336 (not gated), vocab 257, random weights made to give varying greedy tokens:
# inference/token_check.py), end to end and at the bandwidth floor.
#   A. megatron-cp-bench decode --model (bf16, CP = 2): graph vs eager tokens after a real 16k prefill; per-token
#      latency at 128k and 512k, tree and ring decoding, batch 1 (and batch 8 at 128k), graphed, plus eager rows
#      at 128k, each next to the floor (weights + this rank's KV shard at 4.3 TB/s). For these rows the KV cache
#      is filled with random K, V instead of a prefill (a 512k prefill takes minutes; a step reads the same bytes).
#      A configuration that does not fit in memory is a row saying so ("not run: needs X GiB of Y GiB free").
#      PDL=both (default; on, off): each graphed row again without programmatic dependent launch ('graph-nopdl').
#      A_ARGS: more flags for A, e.g. "--variants peer --mlp whole split" (the MLPs split over the CP ranks or not).
#   B. megatron-cp-generate, fp32, a 4k prompt, 32 greedy tokens, graphed: CP = 2 tokens (MLPs split, the default)
#      equal CP = 1 tokens.
#   C. megatron-cp-generate at a 128k prompt (bf16, real prefill, graphed), tree then ring: prefill time,
#      per-token latency, tokens/s and the floor as a user sees them.
# A token comparison (A's graph == eager, B) passes only if the tokens also vary (at least 16 distinct of 32,
# token_check.MIN_DISTINCT): equal constant tokens would not show a wrong merge.
# Writes under $OUT: A.log, B_cp1.log, B_cp2.log, C_tree.log, C_ring.log, summary.txt (one line per step),
# summary.md, decode_model.{json,md}, cp1.json, cp2.json, e2e_tree.json, e2e_ring.json. Exits non-zero if a
# step fails or is skipped for time, or a check FAILs.
set -u
export OUT=${OUT:-results/decode_check}; mkdir -p "$OUT"
if [ -d .whl ] && ! python3 -c "import megatron.core" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
BUDGET=${BUDGET:-395}                     # seconds for everything; a step gets what is left, capped
source "$(dirname "$0")/gpu_steps.sh"
M="--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --num-query-groups 8 --ffn-hidden-size 14336"
prompt() { python3 -c "import random; random.seed($1); print(''.join(random.choice('abcdefghij ') for _ in range($1 - 1)))" > /tmp/prompt_$1.txt; }
prompt 4096; prompt 131072
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$OUT/summary.txt" 2>&1

step A 280 torchrun --nproc-per-node 2 -m megatron_cp_plugin.bench.decode --model --context 131072 524288 \
  --batch 1 8 --tokens 32 --check-context 16384 --eager-context 131072 --pdl "${PDL:-both}" ${A_ARGS:-} \
  --out "$OUT/decode_model"
for n in 1 2; do
  step "B_cp$n" 70 torchrun --nproc-per-node $n -m megatron_cp_plugin.inference.cli $M --prompt-file /tmp/prompt_4096.txt \
    --max-new-tokens 32 --context-parallel-algo ring --decode-mode graph --result-json "$OUT/cp$n.json"
done
for dec in $([ "${E2E:-1}" = 1 ] && echo tree ring); do     # E2E=0 skips C (the 128k end-to-end runs, ~150 s)
  step "C_$dec" 75 torchrun --nproc-per-node 2 -m megatron_cp_plugin.inference.cli $M --bf16 \
    --prompt-file /tmp/prompt_131072.txt --max-new-tokens 32 --context-parallel-algo ring --decoder $dec \
    --decode-mode graph --result-json "$OUT/e2e_$dec.json"
done

python3 - "$OUT" <<'EOF' | tee "$OUT/summary.md"
import json, os, sys
from megatron_cp_plugin.inference.token_check import variety
out = sys.argv[1]
failed = False
def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
print("# Issue 17 GPU check (scripts/gpu_decode_check.sh)\n")
dm = load("decode_model.json")
if dm is None:
    failed = True
    print("A: no decode_model.json (see A.log)")
else:
    print(f"device: {dm['device']}\n\n{dm['header']}\n")
    rows = dm["rows"]
    chk = rows[0]
    if "not_run" in chk:
        failed = True
        print(f"A. {chk['what']}: FAIL, {chk['not_run']}")
    else:
        failed |= not chk.get("ok")
        print(f"A. {chk['what']} after a {chk['context']}-token prefill, {chk['distinct']} distinct of "
              f"{len(chk['tokens_eager'])}: {'PASS' if chk.get('ok') else 'FAIL: ' + chk.get('why', '')}")
    print("\n| context | batch | decoder | mode | variant | mlp | ms/token | tokens/s | floor ms | x floor |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["what"].startswith("latency"):
            if "ms_per_token" not in r:
                print(f"| {r['context']} | {r['batch']} | {r['decoder']} | {r['mode']} | "
                      f"{r.get('not_run') or r.get('error')} ||||||")
            else:
                print(f"| {r['context']} | {r['batch']} | {r['decoder']} | {r['mode']} | {r['variant']} | "
                      f"{r.get('mlp')} | "
                      f"{r['ms_per_token']:.2f} | {r['tokens_per_s']:.1f} | {r['floor_ms']:.2f} | {r['x_floor']:.2f} |")
    lat = {(r["context"], r["batch"], r["decoder"], r["mode"]): r for r in rows
           if r["what"].startswith("latency") and "ms_per_token" in r}
    print()
    for n in (131072, 524288):
        t = lat.get((n, 1, "tree", "graph"))
        if t:
            print(f"target x floor <= 1.5 at {n // 1024}k (tree, graph, b=1): {t['x_floor']:.2f} "
                  f"{'PASS' if t['x_floor'] <= 1.5 else 'MISS'}")
    t, r = lat.get((131072, 1, "tree", "graph")), lat.get((131072, 1, "ring", "graph"))
    if t and r:
        x = r["ms_per_token"] / t["ms_per_token"]
        print(f"target ring / tree >= 4 at 128k (graph, b=1): {x:.2f} {'PASS' if x >= 4 else 'MISS'}")
c1, c2 = load("cp1.json"), load("cp2.json")
if c1 and c2:
    why = variety(c1["tokens"]) or (None if c1["tokens"] == c2["tokens"] else "the CP = 2 tokens differ")
    failed |= why is not None
    print(f"\nB. CP = 2 tokens == CP = 1 tokens (fp32, {c1['prompt_tokens']}-token prompt, 32 greedy, "
          f"{len(set(c1['tokens'][0]))} distinct): {'PASS' if why is None else 'FAIL: ' + why}\n"
          f"  CP=1 {c1['tokens'][0]}\n  CP=2 {c2['tokens'][0]}")
else:
    failed = True
    print("\nB: cp1.json / cp2.json missing (see B_cp1.log, B_cp2.log)")
print("\nC. megatron-cp-generate at a 128k prompt, bf16, graphed (real prefill):")
for dec in ("tree", "ring"):
    e = load(f"e2e_{dec}.json")
    if e is None:
        print(f"  {dec}: no result (see C_{dec}.log)")
        continue
    floor = (e["weight_bytes"] + e["kv_shard_bytes"]) / e["bandwidth"] * 1e3
    med = e["median_token_ms"]
    print(f"  {dec}: prefill {e['prefill_s']:.2f} s, per token {med:.2f} ms ({1e3 / med:.1f} tokens/s), "
          f"floor {floor:.2f} ms, x{med / floor:.2f}; variant {e['variant']}")
sys.exit(1 if failed else 0)
EOF
[ "${PIPESTATUS[0]}" = 0 ] || status=1
echo "done in ${SECONDS} s; results in $OUT (summary.txt, summary.md)"
exit $status
