"""One rank's local work of an algorithm, replayed on one device in one process (issue 26): `RankReplay`, the
aten ops and kernel launches it makes (`count_launches`), its timing (`timed`, `measure`), what a row needs in memory
(`replay_need`) and the cost model's compute factors fitted from a run (`fit`, `refit`). `megatron-cp-bench rank`
(bench/rank_cli.py, where its rows are described) drives it.

Each algorithm runs through its public function and its real autograd backward with torch.distributed swapped,
under comm.py, for a ReplayDist (bench/_replay_comm.py): every receive is an on-device copy of the bytes that rank
would receive, prepared by a first call; on a GPU the copies of what the algorithm posts run on a stream of their
own, as NCCL's kernels, waited for where the algorithm waits. So the kernels, merges, casts, accumulator adds and
comm.py's own packing measured are exactly those of that rank in a P-rank run; only the wire is gone.
tests/test_rank_replay.py checks that a replay fed with a real gloo run's receives gives that run's outputs and
gradients bit for bit.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import cp_grid
from ..cost import compute as cost_compute
from ..cost import HARDWARE, Problem, predict
from ..algos.allgather import GROUPED_MIN_P, allgather_attention
from ..algos.attention2d import attention2d_no
from ..algos.attention2d_o import attention2d_o
from ..algos.burst import burst_attention
from ..algos.ring import ring_attention, ring_te_attention, round_size
from ..kernels import local_attn
from ..kernels import _launch as kernels_launch
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
            g = (r, r) if r * r == P else cp_grid.choose_grid(P)
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

    def __init__(self, algo, P, rank, q, k, v, do, *, grid=None, backend=None, source=None, wire="stream",
                 group_tokens=None):
        if algo not in ALGOS:
            raise ValueError(f"algo must be one of {tuple(ALGOS)}, got {algo!r}")
        self.algo, self.fn, self.backend = algo, ALGOS[algo], backend
        self.q, self.k, self.v = (t.detach().requires_grad_() for t in (q, k, v))
        self.do, self.scale = do, q.shape[-1] ** -0.5
        self.d = ReplayDist(P, rank, source, backend="nccl" if q.is_cuda else "gloo", wire=wire)
        with patched(self.d):
            self.group = (cp_grid.CPGrid(self.d.WORLD, *grid, group_tokens=group_tokens) if algo in GRID_ALGOS
                          else self.d.WORLD)

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


def run_command(argv) -> str:
    """A run's command line as a user types it, for a fit file's `source`: the program as `megatron-cp-bench`
    (`sys.argv[0]` is the path of bench/__main__.py under `python -m`) and without its output paths (--out,
    --fit-out: where that machine wrote, not what it measured)."""
    argv = list(argv.split() if isinstance(argv, str) else argv)
    if argv and argv[0].endswith(("__main__.py", "megatron-cp-bench")):
        argv[0] = "megatron-cp-bench"
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word in ("--out", "--fit-out"):
            skip = True
        elif not word.startswith(("--out=", "--fit-out=")):
            out.append(word)
    return " ".join(out)


def write_fit(path: str, fitted: dict) -> None:
    with open(path, "w") as fh:
        json.dump(fitted, fh, indent=1)
        fh.write("\n")


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
    factors = {k: {P: max(1.0, statistics.fmean(xs)) for P, xs in sorted(per.items(), key=lambda t: int(t[0]))}
               for k, per in acc.items()}
    return {"about": "Per-algorithm compute factors of the cost model (megatron_cp_plugin/cost/compute.py): a "
                     "rank's measured fwd+bwd local work over the ideal, divided by the model's own ratio; mean "
                     "over the problems (lengths, MHA / GQA) of each algorithm, grid and P.",
            "source": f"{command} on {device}", "factors": factors}


def refit(paths, fit_out: str | None) -> int:
    """`--refit`: x_model of every timed row of one or more result JSONs against today's model, and their fit file
    (a cell timed in several files counts each row in its mean)."""
    if not fit_out:
        raise SystemExit("megatron-cp-bench rank: --refit needs --fit-out PATH (where to write the factors)")
    paths = [paths] if isinstance(paths, str) else list(paths)
    rows, sources, devices = [], [], []
    for path in paths:
        with open(path) as fh:
            data = json.load(fh)
        header = data.get("header", "")
        elem = 4 if "torch.float32" in header else 2
        d = int(re.search(r"\bd=(\d+)", header).group(1)) if re.search(r"\bd=(\d+)", header) else 128
        for r in data["rows"]:
            if "x_ideal" in r:
                h, hk = (int(x) for x in r["h/h_kv"].split("/"))
                grid = tuple(int(x) for x in r["grid"].split("x")) if r["grid"] != "-" else None
                r = {**r, "x_model": r["x_ideal"] / model_x_ideal(r["algo"], r["S"], r["P"], h, hk, d, grid, elem)}
            rows.append(r)
        sources.append(run_command(data.get("command", "?")))
        devices.append(data.get("device") or "?")
    out = fit(rows, "; ".join(sources) + f" (refitted from {', '.join(map(str, paths))} against today's cost model)",
              " / ".join(dict.fromkeys(devices)))
    write_fit(fit_out, out)
    print(f"megatron-cp-bench rank --refit: {sum('x_model' in r for r in rows)} rows of {', '.join(map(str, paths))} "
          f"-> {fit_out}")
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


def replay_need(algo, S, P, h, hk, d, elem, grid=None, group_tokens=None) -> float:
    """Bytes one replayed rank allocates beyond its shards (q, k, v, dO, held for every row of a P): the rank's own
    buffers in a P-rank run (cp_attention.attention_need, shards=False) and the prepared receives (MARGIN on
    both)."""
    return (attention_need(algo, S, P, h=h, hk=hk, d=d, elem=elem, grid=grid, shards=False, group_tokens=group_tokens)
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


