#!/usr/bin/env bash
# The whole test suite on one GPU machine (issue 24): every test file, GPU tests included, tests that need several
# ranks in the shared-GPU mode (gloo with CUDA tensors on one device). Prints a summary with the device and the
# counts, writes $OUT/gpu_tests.log and $OUT/junit.xml, exits non-zero on any failure.
# Needs the megatron-core wheel in .whl/ where the GPU image has none (docs/testing.md).
#   OUT=dir bash scripts/gpu_tests.sh [pytest args]        (TESTS="tests/a.py tests/b.py": those files only)
#   SHARD=1/2 ... SHARD=2/2: two sets of test files of about equal time, so that the suite fits two calls of under
#   10 minutes (the whole suite took 665-700 s on 2 x H200 on 2026-11-26: about 250-290 s + 410 s in these two sets)
#   REST="dir ...": only what the earlier runs whose OUT dirs are named did not finish or failed (their running.txt
#   and failures.txt; tests/conftest.py MCP_DONE_RUNS), e.g. after a call cut by LIMIT on one H200, where the suite
#   needs three calls: carry the first call's OUT back (an ignored folder such as dbg/) and name it here
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}; mkdir -p "$OUT"
for d in ${REST:-}; do                    # this run's logs are emptied below: an earlier run's must be elsewhere
  if [ "$(realpath "$d")" = "$(realpath "$OUT")" ]; then
    echo "gpu_tests: REST names OUT ($OUT), whose logs this run starts afresh; give this run another OUT" >&2; exit 2
  fi
done
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
# MCP_FAULT_TIMEOUT: test_faults' --dist-timeout; ranks sharing the GPU start and step slower than CPU ranks
# (8 s, the CPU value, timed out in gloo's first receive on an H100 while 12 test workers shared it).
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 MCP_FAULT_TIMEOUT=${MCP_FAULT_TIMEOUT:-25} PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
DEVICE=$(python3 -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')")
# xdist workers: the suite is mostly process start-up and gloo ranks on the CPU cores (16 on the lent machines).
WORKERS=${WORKERS:-$(( $(nproc) > 16 ? 12 : $(nproc) * 3 / 4 ))}
# The test files, longest first (scripts/test_seconds.tsv; a file not in it counts 30 s): xdist hands tests out in
# collection order, so the long files start first instead of ending the run alone. SHARD=i/n: the i-th of n sets
# of files of about equal seconds (each file to the set with the fewest so far, longest file first).
TESTS=${TESTS:-$(python3 - "${SHARD:-1/1}" <<'PY'
import glob, sys
i, n = map(int, sys.argv[1].split("/"))
secs = dict((f, float(t)) for t, f in (ln.split() for ln in open("scripts/test_seconds.tsv") if ln[0] != "#"))
files = sorted(glob.glob("tests/test_*.py"), key=lambda f: (-secs.get(f, 30.0), f))
load, mine = [0.0] * n, []
for f in files:
    s = min(range(n), key=load.__getitem__)
    load[s] += secs.get(f, 30.0)
    mine += [f] if s == i - 1 else []
print(" ".join(mine))
PY
)}
# Failures named as they happen, and each test's start and end (tests/conftest.py): a run cut off by LIMIT has no
# pytest summary, so the summary names the tests still running then. A test still running after DUMP_AFTER s
# (default 240; the longest test of a green run took 133 s) has every thread's Python stack written to the log
# (pytest's faulthandler_timeout: it also works while the test waits inside C++, a CUDA or gloo call, where
# pytest-timeout's signal cannot interrupt it). --maxschedchunk 1: xdist hands each worker one test at a time, so
# that no long test waits queued behind another worker's while the other workers idle at the end.
export MCP_FAILURE_LOG="$OUT/failures.txt" MCP_RUNNING_LOG="$OUT/running.txt"
export MCP_DONE_RUNS="${REST:-}"
# The tests that took 20 s or more start first, longest first (tests/conftest.py; MCP_LONG_TESTS= turns it off).
export MCP_LONG_TESTS=${MCP_LONG_TESTS-scripts/test_long.tsv}
: > "$MCP_FAILURE_LOG"; : > "$MCP_RUNNING_LOG"
# Every 3 s, each process on a GPU (its memory and command line) to $OUT/gpu_mem.tsv: shard 2 of 2026-11-28 (2 x
# H100) failed 4 tests with CUDA out of memory at context creation, with nothing to say which processes held it.
if command -v nvidia-smi > /dev/null; then
  while :; do
    t=$(date +%s)
    nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory --format=csv,noheader,nounits 2> /dev/null |
      while IFS=', ' read -r gpu pid mib; do
        printf '%s\t%s\t%s\t%s\t%s\n' "$t" "${gpu: -8}" "$pid" "$mib" "$(tr '\0' ' ' < "/proc/$pid/cmdline" 2> /dev/null | cut -c1-240)"
      done
    sleep 3
  done > "$OUT/gpu_mem.tsv" 2> /dev/null &
  sampler=$!
fi
start=$SECONDS
timeout "${LIMIT:-570}" python3 -m pytest -q -n "$WORKERS" --maxschedchunk 1 --timeout 500 -p no:cacheprovider \
  -o faulthandler_timeout="${DUMP_AFTER:-240}" --junitxml "$OUT/junit.xml" $TESTS "$@" 2>&1 | tee "$OUT/gpu_tests.log"
rc=${PIPESTATUS[0]}
[ -n "${sampler:-}" ] && kill "$sampler" 2> /dev/null
gpu_peak=$(python3 scripts/gpu_mem_peak.py "$OUT/gpu_mem.tsv" 2> /dev/null)
counts=$(grep -E "^[0-9]+ (passed|failed)|[0-9]+ (passed|failed).* in " "$OUT/gpu_tests.log" | tail -1)
running=$(python3 - "$MCP_RUNNING_LOG" <<'PY'
import sys, time
started = {}
for line in open(sys.argv[1]):
    what, t, nodeid = line.rstrip("\n").split("\t", 2)
    if what == "start":
        started[nodeid] = int(t)
    else:
        started.pop(nodeid, None)
print("; ".join(f"{n} ({time.time() - t:.0f} s)" for n, t in sorted(started.items(), key=lambda kv: kv[1])))
PY
)
echo "gpu_tests: $(date -u +%F) on $DEVICE, $((SECONDS - start)) s, ${WORKERS} workers${SHARD:+, shard $SHARD}: ${counts:-no summary} (rc=$rc)${running:+; still running: $running}" | tee "$OUT/summary.txt"
[ -n "$gpu_peak" ] && echo "$gpu_peak" | tee -a "$OUT/summary.txt"
grep "^FAILED" "$MCP_FAILURE_LOG"        # with the end of each report there
exit "$rc"
