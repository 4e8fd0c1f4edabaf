#!/usr/bin/env bash
# Issue 15 items 4 and 5 on 2 GPUs (NCCL, bf16): tests/test_faults.py with `megatron-cp-pretrain --nproc 2` on
# GPUs. A rank frozen by SIGSTOP must end the job within --dist-timeout (15 s here) naming it; a rank killed by
# SIGKILL while saving, at once; Ctrl-C during a run saving every step, within a few seconds, with the last
# complete checkpoint readable; kill -9 of the launcher takes the ranks along; never a process left behind.
# About 2.5 minutes; everything stops by $BUDGET s (default 175). From the repo root:
#   OUT=/some/dir bash scripts/gpu_faults_check.sh
# Needs megatron-core (the .whl/ wheels on PYTHONPATH) and pytest. Files under $OUT:
#   faults.log     pytest's output (-rA: each test's verdict, failures with the job's last output lines)
#   processes.txt  processes of this user left after the tests whose command line names megatron_cp_plugin or
#                  multiprocessing (should be empty), and the GPUs' compute processes (should be none)
#   summary.txt    one line per step: exit code and seconds
set -u
export OUT=${OUT:-results}
BUDGET=${BUDGET:-175}
source "$(dirname "$0")/gpu_steps.sh"
if [ "$GPUS" -lt 2 ]; then echo "needs 2 GPUs, found $GPUS" | tee -a "$OUT/summary.txt"; exit 1; fi
python3 -c "import megatron.core, pytest" > /dev/null 2>&1 || {
  echo "megatron-core or pytest not importable: install .whl/ first" | tee -a "$OUT/summary.txt"; exit 1; }
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1} MCP_FAULT_TIMEOUT=15 PYTHONWARNINGS=ignore
step faults 170 python3 -m pytest -q -rA -p no:cacheprovider tests/test_faults.py
sleep 2
{ echo "# left behind (expected: nothing)"
  ps -u "$(id -u)" -o pid,ppid,stat,etime,rss,args | grep -E "megatron_cp_plugin|multiprocessing" | grep -v grep
  echo "# GPU compute processes (expected: none)"
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>&1
} > "$OUT/processes.txt"
cat "$OUT/processes.txt"
tail -5 "$OUT/faults.log"
exit $status
