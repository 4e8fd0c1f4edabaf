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
at the first length of each (algo, grid, P, heads) and the slowest is timed (--rank N fixes it). Per row:
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
import contextlib
import dataclasses
import json
import re
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import comm
from ..cost import compute as cost_compute
from ..cost import HARDWARE, Problem, predict
from ..algos.allgather import GROUPED_MIN_P, allgather_attention
from ..algos.attention2d import attention2d_no
from ..algos.attention2d_o import attention2d_o
from ..algos.burst import burst_attention
from ..algos.ring import ring_attention, ring_te_attention, round_size
from ..kernels import local_attn
from ..kernels import _launch as kernels_launch
from ._common import FLOP_FORMULA, attention_flop, not_fitting, write_report
from .cp_attention import MARGIN, attention_need, input_bytes
from ._replay_comm import ReplayDist, patched

ALGOS = {"ring": ring_attention, "ring-te": ring_te_attention, "burst": burst_attention,
         "allgather": allgather_attention, "attention2d-no": attention2d_no, "attention2d-o": attention2d_o}
GRID_ALGOS = ("attention2d-no", "attention2d-o")


def grids(P: int, which) -> list[tuple[int, int]]:
    """Attention2D grids for P ranks: 'square' (r x r, r = sqrt P; else choose_grid's MHA pick) and 'rect' (2r x
    r/2: more rows, what GQA favours; 4 x 1 at P = 4), or explicit 'RxC' strings."""
    out = []
    r = int(round(P ** 0.5))
    for w in which:
        if w == "square":
            g = (r, r) if r * r == P else comm.choose_grid(P)
        elif w == "rect":
            g = (2 * r, P // (2 * r)) if r * r == P and r % 2 == 0 else (P, 1)
        else:
            g = tuple(int(x) for x in w.lower().split("x"))
        if g[0] * g[1] == P and g not in out:
            out.append(g)
    return out


class RankReplay:
    """Rank `rank` of `algo` over P ranks (grid (R, C) for Attention2D) on local shards q, k, v, do.
    `source`: the receives to replay (None: prepared by the first call, echoing this rank's own sends)."""

    def __init__(self, algo, P, rank, q, k, v, do, *, grid=None, backend=None, source=None, wire="stream"):
        if algo not in ALGOS:
            raise ValueError(f"algo must be one of {tuple(ALGOS)}, got {algo!r}")
        self.algo, self.fn, self.backend = algo, ALGOS[algo], backend
        self.q, self.k, self.v = (t.detach().requires_grad_() for t in (q, k, v))
        self.do, self.scale = do, q.shape[-1] ** -0.5
        self.d = ReplayDist(P, rank, source, backend="nccl" if q.is_cuda else "gloo", wire=wire)
        with patched(self.d):
            self.group = comm.CPGrid(self.d.WORLD, *grid) if algo in GRID_ALGOS else self.d.WORLD

    def __call__(self, backward=True, mark=None):
        """One forward (and backward): (o, dq, dk, dv) or (o,). `mark()` runs between the two."""
        self.d.rewind()
        with patched(self.d):
            o = self.fn(self.q, self.k, self.v, group=self.group, causal=True, softmax_scale=self.scale,
                        backend=self.backend, comm_stats=None, packing=None)
            if mark is not None:
                mark()
            if not backward:
                return (o.detach(),)
            return (o.detach(),) + torch.autograd.grad(o, (self.q, self.k, self.v), self.do)


# ----------------------------------------------------------------------------------------------- counting
_FREE = {"empty", "empty_like", "empty_strided", "_unsafe_view", "detach", "lift_fresh", "alias", "clone_meta"}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that compute (not views, not allocations); attention kernels (local_attn's backend
    tables) and our Triton kernels (merge, accumulate, surrogate O) count once per launch with their insides not
    counted. Where Triton does not run (a CPU without TRITON_INTERPRET=1) those three run as their PyTorch
    references, whose aten ops are counted: a CPU count is then an upper bound on a GPU's launches."""

    def __init__(self):
        super().__init__()
        self.ops = self.attn = 0
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and not func.is_view and func.overloadpacket.__name__ not in _FREE:
            self.ops += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def counting(self, replay: RankReplay):
        tables = [local_attn._FWD, local_attn._BWD, local_attn._VARLEN_FWD, local_attn._VARLEN_BWD]
        saved = [dict(t) for t in tables]

        def wrap(f, attn=True, count=True):
            """f counted as one op (an attention call if attn), its insides not; count=False: not at all (the
            replayed receives stand for the wire)."""
            def call(*a, **k):
                self.attn += attn and count
                self.ops += count
                self.paused += 1
                try:
                    return f(*a, **k)
                finally:
                    self.paused -= 1
            return call

        fills = {n: getattr(replay.d, n) for n in ("_fill", "_fill_many")}

        for t in tables:
            t.update({n: wrap(f) for n, f in t.items()})
        launch = kernels_launch.launch
        kernels_launch.launch = wrap(launch, attn=False)
        for n, f in fills.items():
            setattr(replay.d, n, wrap(f, count=False))
        try:
            with self:
                yield self
        finally:
            for t, s in zip(tables, saved):
                t.update(s)
            kernels_launch.launch = launch
            for n in fills:
                delattr(replay.d, n)


def count_launches(replay: RankReplay) -> dict:
    """ops, attn_calls (and on CUDA kernels, memcpy from torch.profiler) of one fwd+bwd."""
    with OpCounter().counting(replay) as c:
        replay()
    out = {"ops": c.ops, "attn_calls": c.attn}
    if replay.q.is_cuda:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            replay()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        copies = sum(n.startswith(("Memcpy", "Memset")) for n in names)
        out.update(kernels=len(names) - copies, memcpy=copies)
    return out


# ----------------------------------------------------------------------------------------------- timing
def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(replay: RankReplay) -> tuple[float, float]:
    """(fwd ms, bwd ms) of one call: CUDA events around each half (perf_counter on CPU)."""
    dev = replay.q.device
    if dev.type == "cuda":
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        ev[0].record()
        replay(mark=ev[1].record)
        ev[2].record()
        ev[2].synchronize()
        return ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2])
    t = [time.perf_counter()]
    replay(mark=lambda: t.append(time.perf_counter()))
    t.append(time.perf_counter())
    return (t[1] - t[0]) * 1e3, (t[2] - t[1]) * 1e3


def measure(replay: RankReplay, iters: int, budget_s: float, first_ms: float) -> list[tuple[float, float]]:
    """(fwd ms, bwd ms) of n calls; n = what fits in budget_s at first_ms per call (the preparing call's time,
    which warmed the kernels' plans and the allocator), 1 to iters."""
    n = max(1, min(iters, int(budget_s * 1e3 / max(first_ms, 1e-3))))
    return [timed(replay) for _ in range(n)]


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


def single_device_ms(S, h, hk, d, dev, dtype, iters, budget_s) -> float:
    """One device's causal attention fwd+bwd over S tokens (the default kernel), ms."""
    g = torch.Generator(device=dev).manual_seed(S)
    q, k, v, do = (torch.randn(1, S, n, d, device=dev, dtype=dtype, generator=g) for n in (h, hk, hk, h))

    def call():
        o, lse = local_attn.block_fwd(q, k, v, mask="causal")
        local_attn.block_bwd(do, q, k, v, o, lse, mask="causal")

    ts = []
    for i in range(1 + max(1, iters)):
        _sync(dev)
        t0 = time.perf_counter()
        call()
        _sync(dev)
        ts.append((time.perf_counter() - t0) * 1e3)
        if i >= 1 and sum(ts[1:]) > budget_s * 1e3:
            break
    return statistics.median(ts[1:])


# ----------------------------------------------------------------------------------------------- fit
def model_x_ideal(algo, S, P, h, hk, d, grid, elem) -> float:
    """The cost model's compute-only time of one rank (no factor, free links) over its ideal, (F + B) / P at
    its kernel rates: what the model assumes a rank's local work costs beyond the kernels."""
    hw = dataclasses.replace(HARDWARE["h200-nvlink"], intra_bw=1e30, inter_bw=1e30, intra_lat=0.0, inter_lat=0.0)
    pb = Problem(S, P, h, hk, d, 1, elem, True, grid=grid, node_aware=False)
    with cost_compute.disabled():
        pred = predict(algo, pb, hw)
    return pred.total_s / (pred.fwd_flops / hw.fwd_tflops + pred.bwd_flops / hw.bwd_tflops)


def fit(rows, command: str, device: str) -> dict:
    """The cost model's fit file: mean x_model per "<algo> RxC" (and "<algo>" from square grids) and P."""
    acc: dict = {}
    for r in rows:
        if "x_model" not in r:
            continue
        keys = [r["algo"]] if r["grid"] == "-" else [f"{r['algo']} {r['grid']}"]
        R, C = (int(x) for x in r["grid"].split("x")) if r["grid"] != "-" else (0, 0)
        if R and R == C:
            keys.append(r["algo"])
        for key in keys:
            acc.setdefault(key, {}).setdefault(str(r["P"]), []).append(r["x_model"])
    # At least 1.0: a rank runs the ideal's kernels on a share of its FLOPs, so a mean below 1 (0.96-0.99 at 1M
    # P = 16 and 128k P = 4 on the H100 of 2026-11-26) is the ideal's longer run slowed more by the GPU's power cap
    # (700 W, SM 1350-1590 MHz against 1980: ideal_drift), not a rank faster than its kernels.
    factors = {k: {P: max(1.0, statistics.fmean(xs)) for P, xs in per.items()} for k, per in acc.items()}
    return {"about": "Per-algorithm compute factors of the cost model (megatron_cp_plugin/cost/compute.py): a "
                     "rank's measured fwd+bwd local work over the ideal, divided by the model's own ratio; mean "
                     "over the problems (lengths, MHA / GQA) of each algorithm, grid and P.",
            "source": f"{command} on {device}", "factors": factors}


def refit(path: str, fit_out: str | None) -> int:
    """`--refit`: x_model of every timed row of a result JSON against today's model, and its fit file."""
    if not fit_out:
        raise SystemExit("megatron-cp-bench rank: --refit needs --fit-out PATH (where to write the factors)")
    with open(path) as fh:
        data = json.load(fh)
    header = data.get("header", "")
    elem = 4 if "torch.float32" in header else 2
    d = int(re.search(r"\bd=(\d+)", header).group(1)) if re.search(r"\bd=(\d+)", header) else 128
    rows = []
    for r in data["rows"]:
        if "x_ideal" in r:
            h, hk = (int(x) for x in r["h/h_kv"].split("/"))
            grid = tuple(int(x) for x in r["grid"].split("x")) if r["grid"] != "-" else None
            r = {**r, "x_model": r["x_ideal"] / model_x_ideal(r["algo"], r["S"], r["P"], h, hk, d, grid, elem)}
        rows.append(r)
    out = fit(rows, data.get("command", "?") + f" (refitted from {path} against today's cost model)",
              data.get("device") or "?")
    with open(fit_out, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"megatron-cp-bench rank --refit: {sum('x_model' in r for r in rows)} rows of {path} -> {fit_out}")
    return 0


# ----------------------------------------------------------------------------------------------- memory
def _receives(algo, P, h, hk, d, s, e, grid) -> int:
    """Bytes of ReplayDist's prepared receives for one fwd+bwd, one tensor per kind of receive (Q = s h d e,
    K = s h_kv d e, L = h s 4 per rank, fp32 accumulators at 4 bytes). ReplayDist keeps one per distinct shape and
    dtype, so kinds that share one count twice here: the prepared bytes measured on an H200 were 0.2-1.0x this."""
    Q, K, L = s * h * d * e, s * hk * d * e, h * s * 4
    Qa, Ka = Q // e * 4, K // e * 4
    if algo in ("ring", "ring-te") and round_size(P, s) > 1:      # rounds: a K or V chunk; the dK, dV partials
        return K // 2 + (2 * Ka if algo == "ring" else 2 * K)
    if algo in ("ring", "ring-te"):          # K or V blocks; the travelling dK, dV (fp32; ring-te: input dtype)
        return K + (Ka if algo == "ring" and e != 4 else 0)
    if algo == "allgather":                  # every rank's K or V (chunks from GROUPED_MIN_P); the dK, dV partials
        return (P * K // 2 if P >= GROUPED_MIN_P else 2 * P * K) + 2 * P * K
    if algo == "burst" and round_size(P, s) > 1:   # rounds: K or V chunks (forward); Q or dO, D or lse chunks; dQ
        return K // 2 + Q // 2 + L // 2 + Q
    if algo == "burst":                      # K, V; Q or dO; D or lse; dQ
        return K + Q + L + Qa
    R, C = grid
    if algo == "attention2d-no":             # permuted K, V; Q or dO gathered; K, V gathered; D, lse; the packed
        return 2 * K + C * Q + 2 * R * K + 2 * C * L + C * (Qa + L) + C * Qa + 2 * R * K   # bytes of 3 all-to-alls
    return Q + 2 * K + Qa + L + 2 * Ka + 2 * K       # attention2d-o: ring blocks of Q, K, V, o / dQ, lse, dK, dV


def replay_need(algo, S, P, h, hk, d, elem, grid=None) -> float:
    """Bytes one replayed rank allocates beyond its shards (q, k, v, dO, held for every row of a P): the rank's own
    buffers in a P-rank run (cp_attention.attention_need, shards=False) and the prepared receives (MARGIN on
    both)."""
    return (attention_need(algo, S, P, h=h, hk=hk, d=d, elem=elem, grid=grid, shards=False)
            + MARGIN * _receives(algo, P, h, hk, d, S // P, elem, grid))


def shard_bytes(S, P, h, hk, d, elem) -> int:
    """The local q, k, v, dO of one rank (_shards)."""
    return input_bytes(S // P, h=h, hk=hk, d=d, elem=elem)


def single_need(S, h, hk, d, elem) -> float:
    """One device's causal fwd+bwd over S tokens (single_device_ms): its q, k, v, dO and the kernel's own."""
    return input_bytes(S, h=h, hk=hk, d=d, elem=elem) + attention_need("single", S, 1, h=h, hk=hk, d=d, elem=elem)


# ----------------------------------------------------------------------------------------------- driver
def _shards(S, P, h, hk, d, dev, dtype):
    """Random local shards (b = 1): the replay's timing does not depend on which tokens they are."""
    g = torch.Generator(device=dev).manual_seed(S * 7 + h + hk)
    return [torch.randn(1, S // P, n, d, device=dev, dtype=dtype, generator=g) for n in (h, hk, hk, h)]


def _configs(algos, P, grid_names):
    for algo in algos:
        for g in (grids(P, grid_names) if algo in GRID_ALGOS else [None]):
            yield algo, g


def slowest_rank(algo, P, grid, shards, wire="stream") -> int:
    """The rank index whose one fwd+bwd (after a preparing call) takes longest."""
    times = []
    for r in range(P):
        rep = RankReplay(algo, P, r, *shards, grid=grid, wire=wire)
        rep()
        times.append(sum(timed(rep)))
    return max(range(P), key=times.__getitem__)


def _check_args(p, a):
    for name in ("seq_len", "cp", "heads", "kv_heads"):
        for x in getattr(a, name):
            if x < 1:
                p.error(f"--{name.replace('_', '-')} must be positive, got {x}")
    for hk in a.kv_heads:
        if max(a.heads) % hk:
            p.error(f"--kv-heads {hk} must divide --heads {a.heads[0]}")
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
    p.add_argument("--refit", default=None, metavar="JSON", help="run nothing: recompute x_model of a earlier run's "
                   "result (OUT.json) against today's cost model and write --fit-out from it (after a change to the "
                   "model's constants, so that the factors stay relative to the model that reads them)")
    a = p.parse_args(argv)
    if a.refit:
        return refit(a.refit, a.fit_out)
    _check_args(p, a)
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    h, d = a.heads[0], a.head_dim
    rows, picked, single = [], {}, {}
    start = time.perf_counter()
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    header = (f"rank_replay: one rank's local work per algorithm, replayed on one {name} (communication replaced by "
              f"on-device copies, wire {a.wire}); b=1 d={d} causal {dtype}. {FLOP_FORMULA}. "
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
                        replay_need(algo, S, P, h, hk, d, dtype.itemsize, grid), dev)
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
                            picked[key] = [a.rank if a.rank is not None else
                                           slowest_rank(algo, P, grid, shards, a.wire), None]
                        rep = RankReplay(algo, P, picked[key][0], *shards, grid=grid, wire=a.wire)
                        t0 = time.perf_counter()
                        rep()                                             # prepares the receives
                        _sync(dev)
                        first_ms = (time.perf_counter() - t0) * 1e3
                        if picked[key][1] is None:                        # the same code path at every length
                            picked[key][1] = count_launches(rep)
                        if first_ms > a.budget_s * 1e3 / a.passes:
                            long_rows.add(id(row))                        # one pass: see --passes
                        runs.setdefault(id(row), []).append(
                            measure(rep, -(-a.iters // a.passes), a.budget_s / a.passes, first_ms))
                        row["rank"] = picked[key][0]
                        _times(row, runs[id(row)], ideal, ideal_from,
                               lambda: model_x_ideal(algo, S, P, h, hk, d, grid, dtype.itemsize))
                        _x_ring([r for r, *_ in cell])
                        row.update({**picked[key][1], "copies": rep.d.copies,                # of its last call
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
        with open(a.fit_out, "w") as fh:
            json.dump(fit(rows, " ".join(sys.argv), name), fh, indent=1)
    return 0
