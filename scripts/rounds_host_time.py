"""Host time of the ring family's rounds at P = 64, on any machine: one rank's fwd+bwd replayed
(bench/rank_replay.py) at 64 tokens a rank, with ring.ROUND_TOKENS lowered so that the rounds have the shape they
have at 2k tokens a rank (16 peers a round, 4 rounds), so that the kernels are negligible and what is timed is
the Python and dispatcher work the rounds cost a rank: posting 16 peers x 4 tensors a round, the views of the
receive buffers and partials, the merges' launches. At 128k over P = 64 on an H100 every algorithm of the ring
family is host-bound (docs/performance.md, sixteenth session); this measures the host side on the CPU.

    python scripts/rounds_host_time.py [--algos ring burst ring-te] [--reps 5]

Prints the best of --reps means of 10 fwd+bwd per algorithm (ms). The replay's ReplayDist stands in for NCCL,
so torch's own send/recv bookkeeping (and its per-message group lookups) is not in these numbers.
"""
from __future__ import annotations

import argparse
import time

import torch

from megatron_cp_plugin.algos import ring
from megatron_cp_plugin.bench.rank_replay import RankReplay, _shards

P, LOCAL, PEERS = 64, 64, 16


def host_ms(algo: str, reps: int, rank: int = 40) -> float:
    keep, ring.ROUND_TOKENS = ring.ROUND_TOKENS, PEERS * LOCAL      # g = 16 peers a round, as at 2k tokens a rank
    try:
        q, k, v, do = _shards(P * LOCAL, P, 1, 1, 8, torch.device("cpu"), torch.float32)
        rep = RankReplay(algo, P, rank, q, k, v, do)
        rep()                                                       # prepares the receives
        rep()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(10):
                rep()
            best = min(best, (time.perf_counter() - t0) / 10 * 1e3)
        return best
    finally:
        ring.ROUND_TOKENS = keep


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algos", nargs="+", default=["ring", "burst", "ring-te"])
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    for algo in a.algos:
        print(f"{algo}: {host_ms(algo, a.reps):.2f} ms a fwd+bwd (host; P = {P}, rounds of {PEERS})", flush=True)


if __name__ == "__main__":
    main()
