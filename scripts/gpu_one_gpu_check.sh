#!/usr/bin/env bash
# Issue 24 on ONE GPU: determinism and resume bit for bit, at world 1 and at CP = 2 with the ranks sharing the
# GPU (--share-gpu), for the distributed optimizer and Megatron-FSDP; which attention backward is deterministic;
# what --deterministic-mode costs. About 5 minutes; everything stops by $BUDGET s (default 420). From the repo root:
#   OUT=/some/dir bash scripts/gpu_one_gpu_check.sh
# Needs megatron-core and einops (the .whl/ wheels; installed from there when present). Files under $OUT:
#   probe.log         tests/determinism_probe.py: each attention backend's backward, bit-identical or not
#   resume.md         per layout: two uninterrupted runs (saved at 3, on to 6) equal bit for bit, the run resumed
#                     from iteration 3 equal to them in losses and every checkpoint tensor (tests/resume_compare.py)
#   detcost.md        GPT-3 760M at 16k tokens on one GPU, 6 steps, with and without --deterministic-mode
#   summary.txt       one line per step. Exits non-zero if any step fails or is skipped for time.
set -u
if [ "${1:-}" = "" ]; then
  export OUT=${OUT:-results}
  BUDGET=${BUDGET:-420}
  if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=/tmp/site; fi
  source "$(dirname "$0")/gpu_steps.sh"
  export MCP_WORK=$(mktemp -d /tmp/mcp-onegpu-XXXX) PYTHONWARNINGS=ignore
  step probe 90 python3 tests/determinism_probe.py
  step resume 240 bash "$0" resume
  step detcost 150 bash "$0" detcost
  tar -czf "$OUT/work.tar.gz" -C "$MCP_WORK" --exclude='*_ref' --exclude='*_ref2' --exclude='*_res' \
    --exclude='*_start' --exclude='*.pt' . 2>/dev/null
  cat "$OUT/resume.md" "$OUT/detcost.md" 2>/dev/null
  exit $status
fi

W=$MCP_WORK
case $1 in
resume)
  SMALL="--num-layers 2 --hidden-size 1024 --num-attention-heads 8 --seq-length 8192 --micro-batch-size 1 --bf16
   --lr 1e-3 --min-lr 1e-4 --train-iters 6 --save-interval 3 --hidden-dropout 0.1 --mock-data --deterministic-mode"
  run() {  # name nproc, then flags
    local name=$1 np=$2; shift 2
    python3 -m megatron_cp_plugin.pretrain --nproc "$np" --share-gpu $SMALL "$@" --log-json "$W/$name.jsonl" \
      > "$W/$name.log" 2>&1 || { echo "!! $name failed:"; tail -15 "$W/$name.log"; }
  }
  layout() {  # name nproc flags: two uninterrupted runs at once, then the resumed one
    local name=$1 np=$2; shift 2
    run ${name}_ref "$np" "$@" --save "$W/${name}_ref" & run ${name}_ref2 "$np" "$@" & wait
    mkdir -p "$W/${name}_start" && cp -r "$W/${name}_ref/iter_0000003" "$W/${name}_start/" \
      && echo 3 > "$W/${name}_start/latest_checkpointed_iteration.txt"
    run ${name}_res "$np" "$@" --load "$W/${name}_start" --save "$W/${name}_res"
  }
  FSDP="--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"
  layout dopt1 1 --use-distributed-optimizer --context-parallel-algo ring &
  layout fsdp1 1 $FSDP --context-parallel-algo ring &
  layout dopt_cp2 2 --use-distributed-optimizer --context-parallel-algo attention2d-no --context-parallel-size 2 &
  layout fsdp_cp2 2 $FSDP --context-parallel-algo ring --context-parallel-size 2 &
  wait
  python3 -m tests.resume_compare "$W" "$OUT/resume.md" dopt1 fsdp1 dopt_cp2 fsdp_cp2
  ;;
detcost)
  M="--config configs/gpt3-760m.toml --seq-length 16384 --micro-batch-size 1 --train-iters 6 --mock-data
   --context-parallel-algo ring --use-distributed-optimizer"
  for mode in plain deterministic; do
    extra=""; [ $mode = deterministic ] && extra="--deterministic-mode"
    python3 -m megatron_cp_plugin.pretrain $M $extra --result-json "$W/det_$mode.json" > "$W/det_$mode.log" 2>&1 \
      || { echo "!! $mode failed:"; tail -15 "$W/det_$mode.log"; }
  done
  python3 - "$W" "$OUT/detcost.md" <<'PY'
import json, sys
from pathlib import Path
w, out = Path(sys.argv[1]), sys.argv[2]
rows = ["| GPT-3 760M, 16k tokens, 1 GPU, ring, ZeRO-1 | step ms (median of 5) | TFLOP/s | loss at 6 |", "|---|---|---|---|"]
t = {}
for mode in ("plain", "deterministic"):
    r = json.loads((w / f"det_{mode}.json").read_text())
    t[mode] = r["step_time_median_s"]
    rows.append(f"| {mode} | {t[mode] * 1e3:.1f} | {r['tflops_per_gpu']:.1f} | {r['final_loss']:.6f} |")
rows.append(f"\n--deterministic-mode costs {(t['deterministic'] / t['plain'] - 1) * 100:+.1f}% step time")
Path(out).write_text("\n".join(rows) + "\n")
print("\n".join(rows))
PY
  ;;
esac
