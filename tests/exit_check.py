"""Every algorithm at P = 2 on gloo, in a script with no final barrier and no destroy_process_group: each rank's
interpreter must exit 0 (issue 29: attention2d-no ended 3 of 6 such runs with SIGABRT at exit).

    python tests/exit_check.py [--runs 20] [--algos ring burst attention2d-no attention2d-o]

Every run starts two fresh interpreters (the abort happened in interpreter finalization, which a forked rank
does not reproduce), each running forward and backward and then ending its script; the parent reads their exit
statuses and exits 1 naming every failed run. tests/test_cp_attention.py runs it with --runs 2; the 20-run
check is this script as it stands (80 runs: 3.5 min of CPU, 7 min on 2 shared cores)."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ALGOS = ("ring", "burst", "attention2d-no", "attention2d-o")


def _rank(rank: int, algo: str, store_path: str) -> None:
    """One rank: forward + backward and nothing after it (no barrier, no destroy_process_group)."""
    import torch
    import torch.distributed as dist

    import megatron_cp_plugin as mcp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 32, 2, 16) for _ in range(3))
    qs, ks, vs = (mcp.shard_sequence(t, algo=algo).requires_grad_() for t in (q, k, v))
    mcp.context_parallel_attention(qs, ks, vs, algo=algo).sum().backward()


def _one_run(algo: str) -> list[int]:
    """Return codes of the two ranks of one run (negative: killed by that signal)."""
    with tempfile.TemporaryDirectory(prefix="mcp-exit-") as d:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--algos", algo, "--store",
                                   f"{d}/store"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True) for r in range(2)]
        codes = []
        for p in procs:
            _, err = p.communicate(timeout=120)
            if p.returncode:
                print(err[-2000:], file=sys.stderr)
            codes.append(p.returncode)
        return codes


def _describe(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=20, help="runs per algorithm (default 20)")
    p.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)          # a rank of one run (internal)
    p.add_argument("--store", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.rank is not None:
        _rank(a.rank, a.algos[0], a.store)
        return 0
    if a.runs < 1:
        p.error(f"--runs must be at least 1, got {a.runs}")
    failed = []
    for algo in a.algos:
        for i in range(a.runs):
            bad = [f"rank {r}: {_describe(c)}" for r, c in enumerate(_one_run(algo)) if c != 0]
            if bad:
                failed.append(f"{algo} run {i + 1}: " + ", ".join(bad))
        print(f"exit_check: {algo}: {a.runs} runs", flush=True)
    for line in failed:
        print(f"exit_check: FAIL {line}")
    print(f"exit_check: {'FAIL' if failed else 'ok'}: {len(failed)} of {a.runs * len(a.algos)} runs failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
