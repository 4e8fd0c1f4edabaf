"""One rank's local work of every algorithm, replayed on one device in one process (issue 26).

    megatron-cp-bench rank --cp 4 16 64 --seq-len 131072 1048576 --heads 32 --kv-heads 32 8 --out results/rank

Each algorithm runs through its public function and its real autograd backward (algos/ring.py, burst.py,
attention2d.py, attention2d_o.py) with torch.distributed swapped, under comm.py, for a ReplayDist
(bench/_replay_comm.py): every receive is an on-device copy of the bytes that rank would receive (one
multi-tensor copy a posted batch, as NCCL's one grouped launch), prepared by a first call; on a GPU the copies of
what the algorithm posts run on a stream of their own, as NCCL's kernels, waited for where the algorithm waits
(--wire inline: on the rank's stream, serial, as before the eleventh session). So the kernels, merges, casts,
accumulator adds and comm.py's own packing measured are exactly those of that rank in a P-rank run; only the wire
is gone. tests/test_rank_replay.py checks that a replay fed
with a real gloo run's receives gives that run's outputs and gradients bit for bit.

Problems: causal, b = 1, bf16 (--dtype), every --seq-len with every --cp whose local length is at most
--max-local (default: 128k at P = 4, 16, 64 and 1M at P = 16, 64). The slowest rank: every rank index is run once
at the first length of each (algo, grid, P, heads), the four slowest five times more, and the largest median is
timed (--rank N fixes it). Per row:
  fwd_ms, bwd_ms     that rank's forward and backward (CUDA events; the median of up to --iters calls, as many as
                     fit in --budget-s, over --passes passes, each after one warm-up call; a (length, heads, P)
                     cell's rows are timed pass by pass, each pass in the reverse order of the one before; a row
                     whose warm-up call outlasts its share of --budget-s, one pass)
  spread             the row's slowest pass median over its fastest, minus one
  x_ring             fwd_bwd_ms over ring's in the same cell (issue 34's "within 1.05x of ring's time")
  x_ideal            fwd_bwd_ms over the ideal: one-device causal attention fwd+bwd over the whole sequence,
                     timed in this run, / P; above --ideal-max-seq, the FLOPs / P at the rate of the longest
                     whole sequence timed (ideal_from says which)
  ops                aten operations that compute (views and allocations not counted; each attention kernel
                     call and each launch of our Triton kernels counts once, their insides not), per fwd+bwd:
                     the launches of the local work (on a CPU without Triton, those kernels' PyTorch references)
  attn_calls         attention kernel calls per fwd+bwd
  kernels, memcpy    CUDA only: device kernels and memcpy/memset per fwd+bwd (torch.profiler); memcpy includes
                     the replayed receives
  copy_MB            bytes the replayed receives copy per fwd+bwd (what the wire would have written)
  ideal_drift        the ideal re-timed after the rows of its length and heads, over its first time (above 1: the
                     device ran slower by then, e.g. at its power cap; x_ideal is against the first time)
  x_model            x_ideal over the cost model's own x_ideal for that rank (its compute-only prediction over
                     the ideal at its kernel rates): the factor cost/compute.py applies; --fit-out PATH writes
                     their means per (algo, grid, P) as the cost model's fit (megatron_cp_plugin/configs/
                     rank_compute.json)
Memory: before a row (or a one-device ideal) allocates anything, its need from the shapes (`replay_need`) is
checked against what the device has free (`_common.not_fitting`); one that does not fit is a row with `not_run`
("not run: needs X GiB of Y GiB free on <device>", printed) and the run goes on with the next.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ._common import FLOP_FORMULA, attention_flop, not_fitting, write_report
from ._replay_comm import ReplayDist
from .rank_replay import (ALGOS, GRID_ALGOS, RankReplay, _shards, _sync, count_launches, fit, grids, measure,
                          model_x_ideal, refit, replay_need, run_command, shard_bytes, single_device_ms, single_need,
                          timed, write_fit)


def _times(row: dict, passes: list, ideal, ideal_from: str, model) -> None:
    """A row's times from its passes' calls: the medians over all of them; `spread`, the slowest pass's median
    fwd+bwd over the fastest's, minus one (how far the device moved between passes); x_ideal, x_model (`model()`:
    the cost model's x ideal) when there is an ideal."""
    calls = [c for p in passes for c in p]
    f, b = statistics.median(c[0] for c in calls), statistics.median(c[1] for c in calls)
    per_pass = [statistics.median(sum(c) for c in p) for p in passes]
    row.update({"fwd_ms": f, "bwd_ms": b, "fwd_bwd_ms": f + b, "iters": len(calls), "passes": len(passes),
                "spread": max(per_pass) / min(per_pass) - 1})
    if ideal:
        row.update({"ideal_ms": ideal, "x_ideal": (f + b) / ideal, "x_model": (f + b) / ideal / model(),
                    "ideal_from": ideal_from})


def _x_ring(cell: list) -> None:
    """x_ring (after x_model): each timed row's fwd+bwd over ring's in the same cell (same S, h/h_kv and P),
    issue 34's "within 1.05x of ring's time"."""
    ring = next((r for r in cell if r["algo"] == "ring" and "fwd_bwd_ms" in r), None)
    for r in cell:
        if ring is not None and "fwd_bwd_ms" in r:
            r["x_ring"] = r["fwd_bwd_ms"] / ring["fwd_bwd_ms"]


def _configs(algos, P, grid_names):
    for algo in algos:
        for g in (grids(P, grid_names) if algo in GRID_ALGOS else [None]):
            yield algo, g


SLOWEST_TOP, SLOWEST_CALLS = 4, 5
"""slowest_rank's second look: the SLOWEST_TOP slowest ranks of the first, SLOWEST_CALLS timed calls each (median)."""


def slowest_rank(algo, P, grid, shards, wire="stream", group_tokens=None, timer=None) -> int:
    """The rank index whose one fwd+bwd takes longest: every rank timed once (after a preparing call), then the
    SLOWEST_TOP slowest of those SLOWEST_CALLS times each, the largest median deciding. One call a rank picked ring's
    rank 39 at 128k over P = 64 (18.2 ms in the table) where its ranks 0-5 take 19.4-19.5 (one H200, twenty-eighth
    session, docs/results/profile_rank_s28/): there the ranks differ by about one call's noise, and burst's x_ring
    (1.26) was over a rank of ring's that is not its slowest. `timer(rank, calls)` -> median ms replaces the replay
    (tests)."""
    def replayed(r, calls):
        rep = RankReplay(algo, P, r, *shards, grid=grid, wire=wire, group_tokens=group_tokens)
        rep()
        return statistics.median(sum(timed(rep)) for _ in range(calls))
    timer = timer or replayed
    first = [timer(r, 1) for r in range(P)]
    top = sorted(range(P), key=first.__getitem__, reverse=True)[:SLOWEST_TOP]
    again = {r: timer(r, SLOWEST_CALLS) for r in top}
    return max(top, key=again.__getitem__)


def _check_args(p, a):
    for name in ("seq_len", "cp", "heads", "kv_heads"):
        for x in getattr(a, name):
            if x < 1:
                p.error(f"--{name.replace('_', '-')} must be positive, got {x}")
    for hk in a.kv_heads:
        if max(a.heads) % hk:
            p.error(f"--kv-heads {hk} must divide --heads {a.heads[0]}")
    if a.group_tokens is not None and a.group_tokens < 1:
        p.error(f"--group-tokens must be a positive number of query tokens, got {a.group_tokens}")
    if a.passes < 1 or a.iters < 1:
        p.error(f"--passes and --iters must be at least 1, got {a.passes} and {a.iters}")
    if a.rank is not None and not all(0 <= a.rank < P for P in a.cp):
        p.error(f"--rank must be in [0, P) for every --cp, got {a.rank}")
    bad = [x for x in a.algos if x not in ALGOS]
    if bad:
        p.error(f"--algos: unknown {bad}; expected among {tuple(ALGOS)}")


def main(argv=None):
    p = argparse.ArgumentParser(prog="megatron-cp-bench rank", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, nargs="+", default=[131072, 1048576], help="total tokens N")
    p.add_argument("--cp", type=int, nargs="+", default=[4, 16, 64], help="P, the replayed group sizes")
    p.add_argument("--max-local", type=int, default=65536, help="skip N / P above this (1M runs at P >= 16)")
    p.add_argument("--heads", type=int, nargs=1, default=[32])
    p.add_argument("--kv-heads", type=int, nargs="+", default=[32, 8], help="one problem each (MHA, GQA)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--algos", nargs="+", default=list(ALGOS))
    p.add_argument("--grids", nargs="+", default=["square", "rect"], help="Attention2D: square, rect or RxC")
    p.add_argument("--group-tokens", type=int, default=None,
                   help="Attention2D's cap on one grouped kernel call's query tokens (default: cp_grid.GROUP_TOKENS' "
                        "rule, what a run gets where the memory planner finds room)")
    p.add_argument("--rank", type=int, default=None, help="replay this rank (default: the slowest, found by "
                   "running every rank once at the first length)")
    p.add_argument("--wire", choices=ReplayDist.WIRES, default="stream", help="where the replayed receives run on a "
                   "GPU: stream (their own, overlapped as the algorithm posts and waits, as NCCL's) or inline (the "
                   "rank's stream, serial: the replay before the eleventh session)")
    p.add_argument("--iters", type=int, default=10, help="timed calls a row at most, over all its passes")
    p.add_argument("--passes", type=int, default=2, help="time a (length, heads, P) cell's rows this many times, "
                   "each pass in the reverse order of the one before, --iters and --budget-s shared among them; a "
                   "row reports the median over every pass's calls and their spread. A row whose warm-up call "
                   "outlasts its share of --budget-s runs one pass (1M's rows)")
    p.add_argument("--budget-s", type=float, default=3.0, help="seconds of timed calls per row (at least one)")
    p.add_argument("--ideal-max-seq", type=int, default=262144,
                   help="longest whole sequence timed on one device for the ideal; longer ones use its rate")
    p.add_argument("--deadline-s", type=float, default=None, help="start no new row after this many seconds "
                   "(the rows left are reported as not run)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="of q, k, v (bf16 also on CPU, so that "
                   "its casts are counted as on a GPU)")
    p.add_argument("--out", default="results/rank_replay",
                   help="writes OUT.json, OUT.md and OUT.png (the figure, with matplotlib)")
    p.add_argument("--fit-out", default=None, metavar="PATH", help="also write the cost model's compute factors "
                   "(megatron_cp_plugin/configs/rank_compute.json is the one it reads)")
    p.add_argument("--refit", default=None, nargs="+", metavar="JSON", help="run nothing: recompute x_model of "
                   "earlier runs' results (OUT.json; several: their rows together, e.g. a run cut by --deadline-s and "
                   "one of the rows it cut) against today's cost model and write --fit-out from them (also after a "
                   "change to the model's constants, so that the factors stay relative to the model that reads them)")
    a = p.parse_args(argv)
    if a.refit:
        return refit(a.refit, a.fit_out)
    _check_args(p, a)
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    h, d = a.heads[0], a.head_dim
    rows, picked, counted, single = [], {}, {}, {}
    start = time.perf_counter()
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    header = (f"rank_replay: one rank's local work per algorithm, replayed on one {name} (communication replaced by "
              f"on-device copies, wire {a.wire}); b=1 d={d} causal {dtype}; Attention2D's group cap "
              f"{a.group_tokens or 'by cp_grid.GROUP_TOKENS rule'}. {FLOP_FORMULA}. "
              "ideal = one-device fwd+bwd / P. "
              f"ops: aten ops that compute per fwd+bwd (each attention call counts once).")
    for hk in a.kv_heads:
        for S in sorted(a.seq_len):
            runs = [P for P in a.cp if S % (2 * P) == 0 and S // P <= a.max_local]
            if not runs:
                continue
            S1 = S
            while S1 > a.ideal_max_seq and S1 % 2 == 0:
                S1 //= 2
            # The ideal's rate from the longest whole sequence this device holds, halved until it fits (down to
            # 8k, where the kernels still run at full rate); none fits: the rows carry no ideal.
            while S1 % 2 == 0 and S1 > 8192 and not_fitting(single_need(S1, h, hk, d, dtype.itemsize), dev):
                S1 //= 2
            if (S1, hk) not in single:
                why = not_fitting(single_need(S1, h, hk, d, dtype.itemsize), dev)
                if why:
                    print(f"rank_replay: the ideal at S={S1} h/h_kv={h}/{hk}: {why}", flush=True)
                single[S1, hk] = None if why else single_device_ms(S1, h, hk, d, dev, dtype, a.iters, a.budget_s)
            rate = attention_flop(1, S1, h, d, True, True) / single[S1, hk] if single[S1, hk] else None  # FLOP/ms
            ideal_from = "measured" if S1 == S else f"rate at S={S1}"
            for P in runs:
                ideal = attention_flop(1, S, h, d, True, True) / rate / P if rate else None
                why_shards = not_fitting(shard_bytes(S, P, h, hk, d, dtype.itemsize), dev)
                shards = None if why_shards else _shards(S, P, h, hk, d, dev, dtype)
                cell = []                                                 # this P's rows that run
                for algo, grid in _configs(a.algos, P, a.grids):
                    row = {"S": S, "h/h_kv": f"{h}/{hk}", "P": P, "algo": algo,
                           "grid": f"{grid[0]}x{grid[1]}" if grid else "-"}
                    row["not_run"] = why_shards or not_fitting(
                        replay_need(algo, S, P, h, hk, d, dtype.itemsize, grid, a.group_tokens), dev)
                    rows.append(row)
                    if row["not_run"]:
                        print(f"rank_replay: S={S} h/h_kv={h}/{hk} P={P} {algo} {row['grid']}: {row['not_run']}",
                              flush=True)
                        continue
                    del row["not_run"]
                    cell.append((row, algo, grid))
                # The cell's rows in `--passes` passes, each in the reverse order of the one before (A B C, C B A):
                # a device whose clock drifts during the cell (warm-up, a 700 W power cap) then moves every row
                # alike, so that x_ring, a row over ring's in the same cell, compares like with like. One pass
                # each, rows measured one after another, had ring and ring-te (one code in rounds) 12 % apart at
                # 128k P = 16 (62.4 and 69.7 ms, one H100, twenty-second session).
                runs, long_rows = {}, set()
                for n_pass in range(a.passes):
                    for row, algo, grid in (cell if n_pass % 2 == 0 else cell[::-1]):
                        if a.deadline_s is not None and time.perf_counter() - start > a.deadline_s:
                            if not n_pass:                                # rows never timed; later passes: kept
                                for r, *_ in cell:
                                    if id(r) not in runs:
                                        r["not_run"] = "not run: --deadline-s"
                            break
                        if n_pass and id(row) in long_rows:
                            continue
                        key = (algo, grid, P, hk)
                        if key not in picked:
                            picked[key] = (a.rank if a.rank is not None else
                                           slowest_rank(algo, P, grid, shards, a.wire, a.group_tokens))
                        rep = RankReplay(algo, P, picked[key], *shards, grid=grid, wire=a.wire,
                                         group_tokens=a.group_tokens)
                        t0 = time.perf_counter()
                        rep()                                             # prepares the receives
                        _sync(dev)
                        first_ms = (time.perf_counter() - t0) * 1e3
                        if (S, key) not in counted:     # per length: rounds, groups and splits differ by length
                            counted[S, key] = count_launches(rep)
                        if first_ms > a.budget_s * 1e3 / a.passes:
                            long_rows.add(id(row))                        # one pass: see --passes
                        runs.setdefault(id(row), []).append(
                            measure(rep, -(-a.iters // a.passes), a.budget_s / a.passes, first_ms))
                        row["rank"] = picked[key]
                        _times(row, runs[id(row)], ideal, ideal_from,
                               lambda: model_x_ideal(algo, S, P, h, hk, d, grid, dtype.itemsize))
                        _x_ring([r for r, *_ in cell])
                        row.update({**counted[S, key], "copies": rep.d.copies,              # of its last call
                                    "copy_MB": rep.d.copied_bytes / 2**20})
                        del rep                   # its buffers and prepared receives go before the next row's
                        if dev.type == "cuda":
                            torch.cuda.empty_cache()
                        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                              flush=True)
                        write_report(rows, a.out, header, plot={"kind": "rank"}, draw=False)  # survives a kill
                del shards
            # The ideal again after this length's rows (unless out of time): long rows run on a device that has
            # warmed up and may sit at its power cap (an H100 at 700 W: SM clock 1350-1590 MHz against 1980,
            # 2026-11-26), so a late row's x_ideal can carry the device's slowdown; ideal_drift says how much.
            timed = [r for r in rows if r["S"] == S and r["h/h_kv"] == f"{h}/{hk}" and "ideal_ms" in r]
            late = a.deadline_s is not None and time.perf_counter() - start > a.deadline_s
            if timed and single[S1, hk] and not late:
                drift = single_device_ms(S1, h, hk, d, dev, dtype, a.iters, a.budget_s) / single[S1, hk]
                for r in timed:
                    r["ideal_drift"] = drift
                print(f"rank_replay: S={S} h/h_kv={h}/{hk}: the ideal at S={S1} re-timed after the rows: x{drift:.3f} "
                      "of its first time", flush=True)
    print(write_report(rows, a.out, header, plot={"kind": "rank"}))     # bench/plots.py's rank_figure
    if a.fit_out:
        import sys
        write_fit(a.fit_out, fit(rows, run_command(sys.argv), name))
    return 0
