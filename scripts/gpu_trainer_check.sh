#!/usr/bin/env bash
# Issue 14 on 2 GPUs (H200; 4 where present for the resume checks): megatron-cp-pretrain's trainer. About 8
# minutes; everything stops by $BUDGET s (default 520). From the repo root:
#   OUT=/some/dir bash scripts/gpu_trainer_check.sh
# Needs megatron-core (the .whl/ wheels on PYTHONPATH) and einops (Megatron-FSDP imports it).
# Files under $OUT:
#   resume.log, resume.md   distributed optimizer, then Megatron-FSDP optim_grads_params: a run saving at
#                           iteration 3 and going on to 6, a second uninterrupted run (are the GPUs
#                           deterministic?), a run resumed from the first's iteration 3; losses and every
#                           tensor of the final checkpoints (model, fp32 main weights, Adam moments and steps,
#                           generators) compared bit for bit
#   memory.md, memory/      issue 35 items 1 and 3 through scripts/gpu_memory_check.sh: for each step of
#                           MEMORY_STEPS (default m13_32k: GPT-3 13B, 32k tokens, in the layout the planner picks
#                           for these GPUs) and each algorithm of MEMORY_ALGOS (default ring burst attention2d-no
#                           attention2d-o), 3 iterations: step time, tokens/s, TFLOP/s, MFU, and the planner's
#                           peak against the measured one (megatron-cp-bench model), within MEMORY_BUDGET s
#                           (default 270). Items 1 and 3 in full (every GPT-3 run of issue 35 at 32k and 64k,
#                           every algorithm; about 45 minutes on 2 x H200, about half on 4 GPUs, where two steps
#                           run at once, each on its own pair: gpu_memory_check.sh's LANES):
#                             MEMORY_STEPS="m760_32k b2.7_32k f2.7_32k m13_32k b2.7_64k m760_64k f2.7_64k m13_64k"
#                             MEMORY_ALGOS="ring burst allgather ulysses ulysses-ring attention2d-no attention2d-o"
#                             MEMORY_BUDGET=3600 BUDGET=3900 OUT=... bash scripts/gpu_trainer_check.sh
#   plan.log, plan_vs_measured.md   the memory planner's prediction next to measured peak memory for GPT-3 760M
#                           (ZeRO-1) and 2.7B (FSDP ZeRO-3) at 32k, and the memory step's ring runs of m13_32k,
#                           f2.7_32k and f2.7_64k where MEMORY_STEPS has them (issue 35 item 1's FSDP rows:
#                           MEMORY_STEPS="f2.7_32k f2.7_64k"), and the activation bytes autograd keeps per layer on
#                           the GPU against the planner's formula
#   summary.txt             one line per step: exit code and seconds
# Work files (checkpoints, per-run logs and JSON) stay in a temporary directory; work.tar.gz in $OUT keeps
# the logs and JSON. Exits non-zero if any step fails or is skipped for time.
set -u
if [ "${1:-}" = "" ]; then
  export OUT=${OUT:-results}
  BUDGET=${BUDGET:-520}
  source "$(dirname "$0")/gpu_steps.sh"
  if [ "$GPUS" -lt 2 ]; then echo "needs 2 GPUs, found $GPUS" | tee -a "$OUT/summary.txt"; exit 1; fi
  python3 -c "import megatron.core, einops" > /dev/null 2>&1 || {
    echo "megatron-core or einops not importable: install .whl/ (with einops) first" | tee -a "$OUT/summary.txt"
    exit 1; }
  export MCP_WORK=$(mktemp -d /tmp/mcp-trainer-XXXX) MCP_NP=$(( GPUS >= 4 ? 4 : 2 ))
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONWARNINGS=ignore
  # resume: 110 s sufficed on 2 x H200; 2 x H100 (2026-11-27) had the FSDP runs at iteration 3 of 6 then
  # plan: its two runs one after the other on cards under 120 GiB (below)
  export MCP_GPU_GIB=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)")
  step resume 160 bash "$0" resume
  step memory $(( ${MEMORY_BUDGET:-270} + 10 )) bash "$0" memory
  step plan $(( MCP_GPU_GIB >= 120 ? 70 : 120 )) bash "$0" plan
  tar -czf "$OUT/work.tar.gz" -C "$MCP_WORK" --exclude='*_ref' --exclude='*_res' --exclude='*_start' \
    --exclude='*.pt' . 2>/dev/null
  cat "$OUT/resume.md" "$OUT/memory.md" "$OUT/plan_vs_measured.md" 2>/dev/null
  exit $status
fi

W=$MCP_WORK
case $1 in
resume)
  MODEL=${MCP_RESUME_MODEL:-"--num-layers 2 --hidden-size 1024 --num-attention-heads 8 --seq-length 8192"}
  SMALL="$MODEL --micro-batch-size 1 --bf16 --lr 1e-3 --min-lr 1e-4 --train-iters 6 --save-interval 3
   --hidden-dropout 0.1 --mock-data --deterministic-mode"
  run() {  # name, then flags: torchrun on MCP_NP GPUs
    local name=$1; shift
    python3 -m torch.distributed.run --standalone --nproc-per-node "$MCP_NP" -m megatron_cp_plugin.pretrain $SMALL \
      "$@" --log-json "$W/$name.jsonl" > "$W/$name.log" 2>&1 || { echo "!! $name failed:"; tail -15 "$W/$name.log"; }
  }
  for layout in dopt fsdp; do
    if [ $layout = dopt ]; then L="--use-distributed-optimizer --context-parallel-algo attention2d"
    else L="--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --context-parallel-algo ring"; fi
    [ "$MCP_NP" = 4 ] && L="$L --context-parallel-size 2"     # 4 GPUs: sharded over DP 2 x CP 2
    run ${layout}_ref $L --save "$W/${layout}_ref" &          # both uninterrupted runs at once (small model)
    run ${layout}_ref2 $L &
    wait
    mkdir -p "$W/${layout}_start" && cp -r "$W/${layout}_ref/iter_0000003" "$W/${layout}_start/" \
      && echo 3 > "$W/${layout}_start/latest_checkpointed_iteration.txt"
    run ${layout}_res $L --load "$W/${layout}_start" --save "$W/${layout}_res"
  done
  python3 -m tests.resume_compare "$W" "$OUT/resume.md" dopt fsdp
  ;;
memory)
  # gpu_memory_check.sh appends each step's rows to its memory.md as soon as the step is done
  STEPS=${MEMORY_STEPS:-m13_32k} ALGOS=${MEMORY_ALGOS:-"ring burst attention2d-no attention2d-o"} \
    BUDGET=${MEMORY_BUDGET:-270} OUT="$OUT/memory" bash "$(dirname "$0")/gpu_memory_check.sh"
  rc=$?
  cp "$OUT/memory/memory.md" "$OUT/memory.md" 2>/dev/null
  exit $rc
  ;;
plan)
  pre() {  # name, then flags: 3 iterations of a GPT-3 config on 2 GPUs with --result-json; the flags in $W/name.flags
    local name=$1; shift
    local flags="--mock-data --train-iters 3 --seq-length 32768 --context-parallel-algo ring $*"
    echo "$flags" > "$W/$name.flags"
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m megatron_cp_plugin.pretrain $flags \
      --result-json "$W/$name.json" > "$W/$name.log" 2>&1 || { echo "!! $name failed:"; tail -8 "$W/$name.log"; }
  }
  # Both runs and the probe at once on cards of 120 GiB or more (about 35 + 75 + 2 GiB): each process's peak is
  # its own. On 80 GB cards the two runs would not fit together (2 x H100, 2026-11-27: the 2.7B one ran out of
  # memory beside the 760M one), so there one after the other.
  pre p760m --config configs/gpt3-760m.toml &
  [ "${MCP_GPU_GIB:-141}" -ge 120 ] || wait
  pre p2.7b --config configs/gpt3-2.7b.toml --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params &
  python3 -m tests.plan_probe "$W/probe.json" --num-layers 4 --hidden-size 2048 --num-attention-heads 16 \
    --seq-length 8192 --micro-batch-size 1 --bf16 --context-parallel-algo ring --use-distributed-optimizer \
    --nproc 2 > "$W/probe.log" 2>&1 || tail -8 "$W/probe.log" &
  wait
  python3 - "$W" "$OUT/plan_vs_measured.md" "$OUT/memory" <<'EOF'
import dataclasses, json, sys
from pathlib import Path
from megatron_cp_plugin.bench import launch_plan, plan
from megatron_cp_plugin.training.config import parse_args
w, out, mem = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
# (name, result JSON, the run's flags): the planner is asked about the flags the run had, its algorithm included
runs = [("GPT-3 760M, zero1", w / "p760m.json", w / "p760m.flags"),
        ("GPT-3 2.7B, fsdp-optim_grads_params", w / "p2.7b.json", w / "p2.7b.flags")]
# the memory step's ring runs of these steps, where MEMORY_STEPS ran them (their flags are in their JSON)
for step, name in (("m13_32k", "GPT-3 13B, fsdp-optim_grads_params +recompute"),
                   ("f2.7_32k", "GPT-3 2.7B, fsdp-optim_grads_params"),
                   ("f2.7_64k", "GPT-3 2.7B, fsdp-optim_grads_params")):
    if (mem / f"{step}_ring.json").exists():
        runs.append((f"{name} (ring, memory step)", mem / f"{step}_ring.json", None))
lines = ["| run (CP 2) | algo | tokens | predicted GiB (weights/grads/opt/act/transient) | measured peak GiB | error |",
         "|---|---|---|---|---|---|"]
for name, f, flag_file in runs:
    try:
        r = json.loads(f.read_text())
    except (OSError, ValueError) as ex:                 # the run never wrote its result
        r = {"status": f"no result ({type(ex).__name__})"}
    flags = flag_file.read_text().split() if flag_file else r.get("argv", [])
    if "--result-json" in flags:                        # where the run wrote: nothing the planner reads
        i = flags.index("--result-json")
        flags = flags[:i] + flags[i + 2:]
    a = parse_args(flags)
    m, lay = plan.model_from_args(a), launch_plan.config_layout(a)
    if r.get("cp_group_tokens"):                        # the group cap the run's memory check gave it
        m = dataclasses.replace(m, group_tokens=r["cp_group_tokens"])
    e = plan.estimate(m, lay, 2)
    parts = "/".join(f"{getattr(e, k) / 2**30:.1f}" for k in ("weights", "grads", "optimizer", "activations",
                                                              "transient"))
    got = r.get("peak_mem_gb")
    if got:
        cell, err = f"{got:.1f}", f"{(e.total / 2**30 - got) / got * 100:+.1f} %"
    else:                                               # a failed run: say why in the table
        cell, err = f"n/a ({str(r.get('error') or r.get('status'))[:60]})", ""
    lines.append(f"| {name} | {a.context_parallel_algo} | {a.seq_length} | {e.total / 2**30:.1f} ({parts}) | {cell} "
                 f"| {err} |")
try:
    p = json.loads((w / "probe.json").read_text())
    m = plan.Model(4, 2048, 16, 16, 8192, 257, 8192, rope_fused=p.get("rope_fusion", False))
    t = 8192 // 2
    norms = t * (m.layers * 2 * (2 * 2048 + 4) + 2 * 2048 + 4)
    rest = t * (m.layers * m.layer_activation_bytes_per_token(False) + m.final_activation_bytes_per_token(False))
    lines.append(f"\nkept for the backward on {p['device']} (4 layers, hidden 2048, 4096 tokens/GPU): RMSNorms "
                 f"{p['saved_norm_bytes']} B (planner, fused RMSNorm: {norms}), the rest {p['saved_rest_bytes']} B "
                 f"(planner: {rest:.0f})")
except Exception as ex:  # noqa: BLE001
    lines.append(f"\nactivation probe: n/a ({ex})")
Path(out).write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
  ;;
esac
