# shellcheck shell=bash
# Sourced by the scripts/gpu_*_check.sh scripts: their environment and the bounded `step` runner.
# Needs OUT and BUDGET; sets GPUS and status (0, or 1 once a step failed or was skipped for time).
mkdir -p "$OUT"; : > "$OUT/summary.txt"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
status=0
step() {  # step NAME MAX_S CMD...: run CMD, output to $OUT/NAME.log, within MAX_S and what is left of BUDGET
  local name=$1 limit=$2 start=$SECONDS rc; shift 2
  local left=$((BUDGET - SECONDS)); [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 30 ]; then echo "$name: skipped, out of time: $*" | tee -a "$OUT/summary.txt"; status=1; return 1; fi
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; rc=$?
  echo "$name: rc=$rc, $((SECONDS - start)) s (limit $limit): $*" | tee -a "$OUT/summary.txt"
  [ "$rc" = 0 ] || status=1
  return "$rc"
}
echo "GPUs: $GPUS" | tee -a "$OUT/summary.txt"
