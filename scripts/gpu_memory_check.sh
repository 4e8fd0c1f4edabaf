#!/usr/bin/env bash
# Issue 35 item 1 on 2 GPUs: the memory planner's per-GPU peak against the measured one, per CP algorithm, for
# GPT-3 760M (ZeRO-1), 2.7B (distributed optimizer; Megatron-FSDP) and 13B (Megatron-FSDP + full recompute) at
# 32k and 64k tokens, CP = 2. Each step is one `megatron-cp-bench model` run over every algorithm (3 iterations,
# no CP = 1 run, --force: the planner under test must not decide what runs; megatron-cp-pretrain's own check is
# off with it), whose table has plan_GiB, peak_mem_GB (GiB: torch.cuda.max_memory_allocated) and plan_vs_peak.
# Everything stops by $BUDGET s (default 560: one device call); STEPS picks steps (default: all, in this order),
# ALGOS the algorithms of each step (default: every one; a 2.7B run takes ~30-40 s on 2 GPUs, so all seven
# algorithms of one step fill about half a call), STEP_S the seconds one step may take (default 300). The GPT-3 13B
# steps run the layout the planner picks for these GPUs (at 64k on 2 x H200 with the layer inputs on the host,
# --offload-layer-inputs: no layout that keeps them on the GPU fits).
#   OUT=/some/dir bash scripts/gpu_memory_check.sh
#   STEPS="b2.7_64k m13_32k" ALGOS="ring allgather attention2d-o" OUT=/some/dir bash scripts/gpu_memory_check.sh
# EXTRA: megatron-cp-pretrain flags added to every step (e.g. EXTRA=--overlap-grad-reduce).
# Files under $OUT: <step>.log, <step>.md (the bench table), memory.md (every step's rows, plan vs peak),
# summary.txt. Exits non-zero if a step fails or is skipped for time. With 4 GPUs two steps run at once, each on its
# own pair (LANES, below).
set -u
export OUT=${OUT:-results}
BUDGET=${BUDGET:-560}
source "$(dirname "$0")/gpu_steps.sh"
if [ "$GPUS" -lt 2 ]; then echo "needs 2 GPUs, found $GPUS" | tee -a "$OUT/summary.txt"; exit 1; fi
export PYTHONWARNINGS=ignore

FSDP="--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"
declare -A RUN=(
  [m760_32k]="--config configs/gpt3-760m.toml --seq-length 32768 --use-distributed-optimizer"
  [b2.7_32k]="--config configs/gpt3-2.7b.toml --seq-length 32768 --use-distributed-optimizer"
  [f2.7_32k]="--config configs/gpt3-2.7b.toml --seq-length 32768 $FSDP"
  [m13_32k]="--config configs/gpt3-13b.toml --seq-length 32768 PLANNED"
  [b2.7_64k]="--config configs/gpt3-2.7b.toml --seq-length 65536 --use-distributed-optimizer"
  [m760_64k]="--config configs/gpt3-760m.toml --seq-length 65536 --use-distributed-optimizer"
  [f2.7_64k]="--config configs/gpt3-2.7b.toml --seq-length 65536 $FSDP"
  [m13_64k]="--config configs/gpt3-13b.toml --seq-length 65536 PLANNED"
)
# PLANNED: the layout the planner picks for 2 of these GPUs (launch_plan --layout auto, as megatron-cp-pretrain's
# memory check and the SLURM scripts pick it): FSDP ZeRO-3 + full recompute at 32k, + the layer inputs on the host
# at 64k on 2 x H200 (issue 35 item 3: "with a layout the planner chooses")
CAP=$(python3 -c "from megatron_cp_plugin import devices; print(devices.gpu_capacity_gib() or '')")
planned() {  # the step's flags with PLANNED replaced by the planner's layout flags, or nothing when none fits
  local base=${1/PLANNED/}
  # shellcheck disable=SC2086
  python3 -m megatron_cp_plugin.bench.launch_plan --trainer plugin --layout auto --gpus 2 --gpu-mem "$CAP" -- \
    $base 2>> "$OUT/summary.txt" | tail -n +2 | tr '\n' ' '
}
ORDER="m760_32k b2.7_32k f2.7_32k m13_32k b2.7_64k m760_64k f2.7_64k m13_64k"
run_step() {  # one step on the GPU pair this lane sees; its table rows to $OUT/<step>.rows
  local s=$1 flags
  [ -n "${RUN[$s]:-}" ] || { echo "$s: unknown step (one of $ORDER)" | tee -a "$OUT/summary.txt"; status=1; return; }
  flags=${RUN[$s]}
  if [[ $flags == *PLANNED* ]]; then
    flags=$(planned "$flags")
    [ -n "$flags" ] || { echo "$s: the planner fits no layout on ${CAP} GiB GPUs" | tee -a "$OUT/summary.txt"; status=1
                         return; }
  fi
  # shellcheck disable=SC2086
  step "$s" "${STEP_S:-300}" python3 -m megatron_cp_plugin.bench model --nproc 2 --no-cp1 --force --train-iters 3 \
    ${ALGOS:+--algos $ALGOS} --out "$OUT/$s" $flags ${EXTRA:-}
  { echo "## $s: $flags${CUDA_VISIBLE_DEVICES:+ (GPUs $CUDA_VISIBLE_DEVICES)}"
    grep -E "^\| (run|---|ring|burst|attention2d|allgather|ulysses)" "$OUT/$s.md"; echo; } > "$OUT/$s.rows" 2>/dev/null
}
# Lanes: with 4 or more GPUs, LANES (default GPUs / 2) pairs of GPUs each take the next step not yet taken (a
# mkdir claims it), so two steps run at once on 4 GPUs: the full sweep (about 45 minutes on 2 x H200) in about
# half. Each run's memory is its own GPUs'; the step times of runs sharing a host may be a little slower (LANES=1
# for timings).
lanes=${LANES:-$(( GPUS / 2 ))}
visible=(${CUDA_VISIBLE_DEVICES:-})
visible=(${visible[@]//,/ })
[ ${#visible[@]} -ge "$GPUS" ] || visible=($(seq 0 $((GPUS - 1))))
lane() {
  local i=$1
  [ "$lanes" -gt 1 ] && export CUDA_VISIBLE_DEVICES=${visible[$((2 * i))]},${visible[$((2 * i + 1))]}
  for s in ${STEPS:-$ORDER}; do
    mkdir "$OUT/.claimed_$s" 2>/dev/null && run_step "$s"
  done
  echo "$status" > "$OUT/.lane_$i"
}
rm -rf "$OUT"/.claimed_* "$OUT"/.lane_*
for ((i = 0; i < lanes; i++)); do lane "$i" & done
wait
for ((i = 0; i < lanes; i++)); do [ "$(cat "$OUT/.lane_$i" 2>/dev/null)" = 0 ] || status=1; done
: > "$OUT/memory.md"
for s in ${STEPS:-$ORDER}; do cat "$OUT/$s.rows" >> "$OUT/memory.md" 2>/dev/null; done
rm -rf "$OUT"/.claimed_* "$OUT"/.lane_*
cat "$OUT/memory.md"
exit $status
