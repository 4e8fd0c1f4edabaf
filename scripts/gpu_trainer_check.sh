#!/usr/bin/env bash
# GPU checks of megatron-cp-pretrain's trainer (issue 14), from the repo root on 2 GPUs (4 where present):
#   1. resume equality with Megatron's distributed optimizer, then with Megatron-FSDP (ZeRO-3): a run saving at
#      iteration 3 and going on to 6, a second uninterrupted run (how deterministic the GPUs are), and a run
#      resumed from the first one's iteration 3: losses, and every tensor of the final checkpoints (model,
#      fp32 main weights, Adam moments, generators), compared bit for bit;
#   2. GPT-3 13B (configs/gpt3-13b.toml) at 32k tokens, Megatron-FSDP optim_grads_params + full recompute,
#      CP = 2, every algorithm: step time, tokens/s, MFU, peak memory (megatron-cp-bench model);
#   3. the memory planner's prediction next to measured peak memory for three configurations, and the
#      activation bytes autograd keeps per layer on the GPU (the planner's RMSNorm assumption).
# Needs megatron-core (the lead installs .whl/ first) and einops (Megatron-FSDP imports it). Everything lands in
# $OUT (at most 8 files): log.txt, resume.md, model_13b.md/.json, plan_vs_measured.md, work.tar.gz.
#   OUT=/tmp/out bash scripts/gpu_trainer_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_trainer_check}
mkdir -p "$OUT"
W=$(mktemp -d /tmp/mcp-trainer-XXXX)
PY=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True CUBLAS_WORKSPACE_CONFIG=:4096:8
export PYTHONWARNINGS=ignore
LOG=$OUT/log.txt
NGPU=$(nvidia-smi -L | wc -l)
NP=$(( NGPU >= 4 ? 4 : 2 ))
exec > >(tee -a "$LOG") 2>&1
echo "== $(date -u) $(nvidia-smi -L | head -1) x $NGPU; resume checks on $NP GPUs; torch $($PY -c 'import torch; print(torch.__version__)')"
$PY -c "import megatron.core, einops; print('megatron-core', megatron.core.__version__)" || {
  echo "megatron-core or einops missing: install .whl/ (with an einops wheel) first"; exit 1; }
T0=$SECONDS

# ------------------------------------------------------------------------------------------ 1. resume
SMALL="--num-layers 2 --hidden-size 1024 --num-attention-heads 8 --seq-length 8192 --micro-batch-size 1 --bf16
 --lr 1e-3 --min-lr 1e-4 --train-iters 6 --save-interval 3 --hidden-dropout 0.1 --mock-data --deterministic-mode"
run() {  # name, then flags; torchrun on $NP GPUs, its own port
  local name=$1; shift
  $PY -m torch.distributed.run --standalone --nproc-per-node "$NP" -m megatron_cp_plugin.pretrain $SMALL "$@" \
    --log-json "$W/$name.jsonl" > "$W/$name.log" 2>&1 || { echo "!! $name failed:"; tail -15 "$W/$name.log"; }
}
for layout in dopt fsdp; do
  if [ $layout = dopt ]; then L="--use-distributed-optimizer --context-parallel-algo attention2d"
  else L="--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --context-parallel-algo ring"; fi
  [ "$NP" = 4 ] && L="$L --context-parallel-size 2"        # 4 GPUs: sharded over DP 2 x CP 2
  run ${layout}_ref $L --save "$W/${layout}_ref" &        # both uninterrupted runs at once: small model
  run ${layout}_ref2 $L &
  wait
  mkdir -p "$W/${layout}_start" && cp -r "$W/${layout}_ref/iter_0000003" "$W/${layout}_start/" \
    && echo 3 > "$W/${layout}_start/latest_checkpointed_iteration.txt"
  run ${layout}_res $L --load "$W/${layout}_start" --save "$W/${layout}_res"
  echo "   $layout done at $((SECONDS - T0)) s"
done
$PY - "$W" "$OUT/resume.md" <<'EOF'
import json, sys, torch
from pathlib import Path
from tests.ckpt_compare import read_checkpoint as _read, same as _same
w, out = Path(sys.argv[1]), sys.argv[2]
losses = lambda n: [json.loads(l)["loss"] for l in open(w / f"{n}.jsonl")] if (w / f"{n}.jsonl").exists() else []
lines = ["| layout | uninterrupted = 2nd uninterrupted | resumed = uninterrupted (losses 4-6) | checkpoint tensors "
         "equal / differing (max abs diff) | verdict |", "|---|---|---|---|---|"]
for layout in ("dopt", "fsdp"):
    ref, ref2, res = losses(f"{layout}_ref"), losses(f"{layout}_ref2"), losses(f"{layout}_res")
    det = len(ref) == 6 and ref == ref2
    same = len(res) == 3 and res == ref[3:]
    try:
        a = _read(w / f"{layout}_ref/iter_0000006", w)
        b = _read(w / f"{layout}_res/iter_0000006", w)
        bad = [k for k in a if k not in b or not _same(a[k], b[k])]
        worst = max((float((a[k].float() - b[k].float()).abs().max()) for k in bad
                     if isinstance(a[k], torch.Tensor) and k in b and a[k].shape == b[k].shape), default=0.0)
        moments = sum("exp_avg" in k for k in a)
        ck = f"{len(a) - len(bad)} / {len(bad)} ({worst:.3g}); {moments} Adam tensors"
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        bad, ck = ["?"], f"not compared: {type(e).__name__}"
    verdict = ("FAIL: a run failed (log.txt)" if len(ref) < 6 or len(res) < 3 else
               "PASS (bit-exact)" if same and not bad else
               "FAIL" if det else "GPU not deterministic: compare the differences")
    lines.append(f"| {layout} | {det} | {same} {ref[3:]} vs {res} | {ck} | {verdict} |")
    if not det:
        lines.append(f"| {layout} | uninterrupted {ref} vs 2nd {ref2} | | | |")
Path(out).write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF

# ------------------------------------------------------------------------------------------ 2. GPT-3 13B
echo "== GPT-3 13B, 32k tokens, Megatron-FSDP optim_grads_params + full recompute, CP 2 ($((SECONDS - T0)) s)"
$PY -m megatron_cp_plugin.bench model --nproc 2 --no-cp1 --out "$W/model_13b" --train-iters 3 \
  --config configs/gpt3-13b.toml configs/recompute-full.toml --seq-length 32768 \
  --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params
cp "$W/model_13b.md" "$W/model_13b.json" "$OUT/" 2>/dev/null

# ------------------------------------------------------------------------------------------ 3. planner
echo "== planner vs measured ($((SECONDS - T0)) s)"
pre() {  # name, then flags: 3 iterations of a GPT-3 config on 2 GPUs with --result-json
  local name=$1; shift
  $PY -m torch.distributed.run --standalone --nproc-per-node 2 -m megatron_cp_plugin.pretrain --mock-data \
    --train-iters 3 --seq-length 32768 --context-parallel-algo ring --result-json "$W/$name.json" "$@" \
    > "$W/$name.log" 2>&1 || { echo "!! $name failed:"; tail -8 "$W/$name.log"; }
}
pre p760m --config configs/gpt3-760m.toml
pre p2.7b --config configs/gpt3-2.7b.toml --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params
$PY -m tests.plan_probe "$W/probe.json" --num-layers 4 --hidden-size 2048 --num-attention-heads 16 \
  --seq-length 8192 --micro-batch-size 1 --bf16 --context-parallel-algo ring --use-distributed-optimizer \
  --nproc 2 > "$W/probe.log" 2>&1 || tail -8 "$W/probe.log"
$PY - "$W" "$OUT/plan_vs_measured.md" <<'EOF'
import json, sys
from pathlib import Path
from megatron_cp_plugin.bench import plan
from megatron_cp_plugin.training.config import parse_args
w, out = Path(sys.argv[1]), sys.argv[2]
runs = [("GPT-3 760M, zero1", "p760m.json", ["--config", "configs/gpt3-760m.toml"], plan.Layout("zero1")),
        ("GPT-3 2.7B, fsdp-optim_grads_params", "p2.7b.json", ["--config", "configs/gpt3-2.7b.toml"],
         plan.Layout("fsdp-optim_grads_params")),
        ("GPT-3 13B, fsdp-optim_grads_params +recompute (ring)", "model_13b_ring.json",
         ["--config", "configs/gpt3-13b.toml"], plan.Layout("fsdp-optim_grads_params", recompute=True))]
lines = ["| run (32k tokens, CP 2) | predicted GiB (weights/grads/opt/act/transient) | measured peak GiB | "
         "error |", "|---|---|---|---|"]
for name, f, argv, lay in runs:
    m = plan.model_from_args(parse_args(argv + ["--seq-length", "32768"]))
    e = plan.estimate(m, lay, 2)
    parts = "/".join(f"{getattr(e, k) / 2**30:.1f}" for k in ("weights", "grads", "optimizer", "activations",
                                                              "transient"))
    try:
        got = json.loads((w / f).read_text())["peak_mem_gb"]
        err = f"{(e.total / 2**30 - got) / got * 100:+.1f} %"
    except Exception as ex:
        got, err = f"n/a ({type(ex).__name__})", ""
    lines.append(f"| {name} | {e.total / 2**30:.1f} ({parts}) | {got if isinstance(got, str) else f'{got:.1f}'} "
                 f"| {err} |")
try:
    p = json.loads((w / "probe.json").read_text())
    m = plan.Model(4, 2048, 16, 16, 8192, 257, 8192)
    t = 8192 // 2
    norm_pred = t * (m.layers * 2 * (2 * 2048 + 4) + 2 * 2048 + 4)
    lines.append(f"\nsaved for backward on {p['device']}: norms {p['saved_norm_bytes']} B (planner, fused RMSNorm: "
                 f"{norm_pred}), rest {p['saved_rest_bytes']} B (planner: "
                 f"{t * (m.layers * m.layer_activation_bytes_per_token(False) + m.final_activation_bytes_per_token(False)):.0f})")
except Exception as ex:
    lines.append(f"\nactivation probe: n/a ({ex})")
Path(out).write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
tar -czf "$OUT/work.tar.gz" -C "$W" --exclude='*_ref' --exclude='*_res' --exclude='*_start' --exclude='*.pt' . \
  2>/dev/null
echo "== done in $((SECONDS - T0)) s; results in $OUT"
