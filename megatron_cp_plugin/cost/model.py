"""Analytical cost model of every algorithm: FLOPs and bytes per rank, and a predicted time.

Per rank and call, for a problem (N tokens over P ranks, b, h, h_kv, d, element size e) on some hardware:
  compute  causal-aware attention FLOPs: forward 4 b h N^2 d / P (x 1/2 causal; zigzag and cyclic layouts
           balance the causal work), backward 2.5 x forward (recompute QK^T + 4 matmuls), at the kernel's
           measured TFLOP/s; plus the memory-bound (o, lse) merges and gradient-accumulator adds.
  bytes    exactly what the algorithms' CommStats counters count (tests/test_cost_model.py checks every
           algorithm on gloo): burst-attention.txt Table 1 (ring: K, V forward; K, V, dK, dV backward; burst:
           Q, dQ, dO, D, lse backward) and attention2d.txt Sec. 3.3 (permutation, row / column gathers and
           reduce-scatters), with the ring-collective convention of comm.py (all-gather / reduce-scatter over g
           ranks: g - 1 chunks; all-reduce: 2 (g - 1) / g of the buffer).
  time     per step max(compute, communication + latency) where the algorithm overlaps them (ring, burst,
           attention2d-o), their sum where it does not (attention2d-no's collectives), over the links of
           hardware.py: ring and burst cross nodes once P > GPUs per node; Attention2D's node-aware
           row-major placement keeps grid rows inside a node (row traffic intra-node, column traffic inter-node).

This module holds the ring and Attention2D entries, the shared Problem and Prediction, `predict`, `comm_bytes`,
`best_grid` and `choose_algo`; the package's other modules: hardware.py (HARDWARE presets, links), collective.py
(allgather, ulysses, ulysses-ring entries), compute.py (measured compute factors), decode.py (decode steps,
`choose_tree_variant`). Their public names are importable from the package (`megatron_cp_plugin.cost`). The
reports comparing predictions with measurements: `megatron-cp-bench cost-model` (bench/cost_report.py,
docs/cost_model.md).

Not modelled: kernel efficiency falling on small blocks, contention between the compute and NCCL's copy kernels,
NCCL protocol switches (decode's host overhead: decode.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..algos import registry
from ..algos.ring import round_size
from ..comm import wire_bytes
from ..cp_grid import attention2d_bytes, choose_grid, grid_rank, group_chunks, kv_moves, overlap_pays
from . import compute as cost_compute
from .hardware import (ADD_BYTES, ATTNFIX_BYTES, HARDWARE, MERGE_BYTES, Hardware, check_int, overlapped, pairs_link,
                       phase_link)


@dataclass(frozen=True)
class Problem:
    """One context-parallel attention call (one layer), the unit the algorithms' byte counters count."""

    seq_len: int
    """N, the full sequence length."""
    world: int
    """P, the context-parallel group size."""
    heads: int
    """h, query heads (per tensor-parallel rank)."""
    kv_heads: int | None = None
    """h_kv, key/value heads (h % h_kv == 0); None: h (MHA)."""
    head_dim: int = 128
    """d."""
    batch: int = 1
    """b, sequences per call (micro-batch)."""
    dtype_bytes: int = 2
    """e, element size of q, k, v: 2 (bf16/fp16), 4 (fp32) or 8 (fp64; accumulators are then fp64 too)."""
    causal: bool = True
    """Causal mask (half the FLOPs; the layouts balance it)."""
    grid: tuple[int, int] | None = None
    """Attention2D grid (R, C), R * C == P; None: cp_grid.choose_grid's, as at run time."""
    node_aware: bool = True
    """Attention2D places grid rows inside a node (CPGrid(..., gpus_per_node)) when C divides GPUs per node."""
    group_tokens: int | None = None
    """Attention2D's cap on one grouped kernel call's query tokens (cp_grid.GROUP_TOKENS); None: its default rule, as at
    run time without --cp-group-tokens. Every measured set ran shards whose groups both caps give alike."""
    backward: bool = True
    """Training (forward + backward) or forward only (prefill): what choose_algo minimises."""
    fp32_one_hop: bool = False
    """The neighbour rings' gradient accumulators in fp32 even where they make one hop (P = 2; ulysses-ring's ring
    of two groups): the code before the twenty-second session, which the measured sets of that time ran. False:
    today's, where one hop travels in the input dtype (`comm.wire_dtype`)."""
    a2d_no_waits: bool = False
    """Attention2D-NO's schedule before the twenty-third session, which the measured sets of that time ran: every
    gather waited for before any compute. False: today's, where a rank whose chunk pairs are calls of their own
    computes its own pair while the gathers travel (`attention2d.pair_order`)."""
    a2d_no_exchange_waits: bool = False
    """Attention2D-NO's backward before the twenty-fourth session, which every measured set of that time ran: its
    dK, dV exchange in the column after its last pair. False: today's, where an R x 1 grid posts it before the own
    pair's keys [s1:] and computes those while it travels (`attention2d.own_split`)."""

    def __post_init__(self):
        for f in ("seq_len", "world", "heads", "head_dim", "batch"):
            check_int(f"Problem.{f}", getattr(self, f))
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        check_int("Problem.kv_heads", self.kv_heads)
        if self.heads % self.kv_heads:
            raise ValueError(f"Problem.heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads})")
        if self.dtype_bytes not in (2, 4, 8):
            raise ValueError(f"Problem.dtype_bytes must be 2, 4 or 8, got {self.dtype_bytes!r}")
        if self.seq_len % self.world:
            raise ValueError(f"Problem.seq_len {self.seq_len} must be divisible by world {self.world}")
        if self.grid is not None:
            g = tuple(self.grid)
            if len(g) != 2 or any(not isinstance(x, int) or x < 1 for x in g) or g[0] * g[1] != self.world:
                raise ValueError(f"Problem.grid must be (rows, cols) with rows * cols == world {self.world}, "
                                 f"got {self.grid!r}")
            object.__setattr__(self, "grid", g)

    @property
    def acc_bytes(self) -> int:
        """Accumulator element size (fp32, fp64 for fp64 inputs), as kernels.local_attn.acc_dtype."""
        return 8 if self.dtype_bytes == 8 else 4

    def attention2d_grid(self) -> tuple[int, int]:
        return self.grid or choose_grid(self.world, h=self.heads, h_kv=self.kv_heads)

    def feasible(self, algo: str) -> bool:
        """Whether `algo`'s layout can shard seq_len (zigzag: 2P chunks; cyclic: P)."""
        return self.seq_len % registry.divisor(algo, self.world) == 0


@dataclass(frozen=True)
class Prediction:
    """Predicted cost of one call on the slowest rank."""

    algo: str
    fwd_s: float
    """Forward seconds."""
    bwd_s: float
    """Backward seconds."""
    fwd_bytes: int
    """Bytes this rank sends in the forward (CommStats.forward_bytes)."""
    bwd_bytes: int
    """Bytes sent in the backward (CommStats.backward_bytes)."""
    fwd_flops: float
    """Attention FLOPs per rank, forward."""
    bwd_flops: float
    """Attention FLOPs per rank, backward."""
    grid: tuple[int, int] | None = None
    """Attention2D's (R, C)."""
    row_major: bool = False
    """Attention2D's placement: grid rows inside a node."""

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s


# ----------------------------------------------------------------------------------------------- compute
def attention_flops(pb: Problem) -> tuple[float, float]:
    """(forward, backward) attention FLOPs per rank: 4 b h N^2 d (x 1/2 causal) / P, backward 2.5 x forward."""
    f = 4.0 * pb.batch * pb.heads * pb.seq_len ** 2 * pb.head_dim * (0.5 if pb.causal else 1.0) / pb.world
    return f, 2.5 * f


def _sizes(pb: Problem):
    s = pb.seq_len // pb.world
    n_q = pb.batch * s * pb.heads * pb.head_dim
    n_kv = pb.batch * s * pb.kv_heads * pb.head_dim
    n_r = pb.batch * pb.heads * s
    return s, n_q, n_kv, n_r, pb.dtype_bytes, pb.acc_bytes


# ----------------------------------------------------------------------------------------------- ring, burst
def ring_family_cost(algo: str, pb: Problem, hw: Hardware, rank: int | None = None) -> Prediction:
    """The cost-model entry of ring, burst and ring-te (every rank sends the same: `rank` does not matter)."""
    P = pb.world
    _, n_q, n_kv, n_r, e, acc = _sizes(pb)
    F, B = attention_flops(pb)
    link = phase_link([list(range(P))], hw, p2p=True)
    # Forward (ring.py ring_forward, also burst's): K, V round the ring; the slowest rank (P - 1 under zigzag
    # causal) merges all its rows at every step.
    m_kv = 2 * n_kv * e
    cf = F / P / hw.fwd_tflops
    merge = n_q * MERGE_BYTES / hw.mem_bw
    comp = [cf] + [cf + merge] * (P - 1)
    fwd = overlapped(comp[:-1], [link.t(m_kv)] * (P - 1)) + comp[-1]
    fwd_bytes = (P - 1) * m_kv
    # Backward: a travelling block posted before the step's compute, and a gradient accumulator sent after it
    # (waited one step later), which the last hop brings home after the loop.
    cb = B / P / hw.bwd_tflops
    # In rounds (ring.round_size > 1: short shards) ring's dK, dV partials are summed once, at their owner, and travel
    # in the input dtype (ring.RoundPartials), and so do burst's dQ partials; the timing below is the neighbour ring's.
    # So at P = 2, where an accumulator makes one hop (comm.wire_dtype).
    g_acc = e if round_size(P, pb.seq_len // P) > 1 or (P == 2 and not pb.fp32_one_hop) else acc
    if algo == "ring":                  # K, V and dK, dV (fp32; the input dtype in rounds and at P = 2)
        m_blk, m_acc = 2 * n_kv * e, 2 * n_kv * g_acc
    elif algo == "ring-te":             # TransformerEngine's budget: dK, dV in the input dtype
        m_blk, m_acc = 2 * n_kv * e, 2 * n_kv * e
    else:                               # burst: Q, dO, D, lse and dQ (fp32; as ring's dK, dV); K, V stay
        m_blk, m_acc = 2 * n_q * e + 2 * n_r * acc, n_q * g_acc
    adds = (n_q + 2 * n_kv) * ADD_BYTES / hw.mem_bw     # both add a dQ and a dK, dV block per step
    comp = [cb + adds] * P
    comm = [link.t(m_blk + (m_acc if i >= 2 else 0), 2 if i >= 2 else 1) for i in range(P - 1)]
    bwd = (overlapped(comp[:-1], comm) + max(comp[-1], link.t(m_acc) if P > 2 else 0.0)
           + (link.t(m_acc) if P > 1 else 0.0))
    bwd_bytes = (P - 1) * (m_blk + m_acc)
    return Prediction(algo, fwd, bwd, fwd_bytes, bwd_bytes, F, B)


# ----------------------------------------------------------------------------------------------- attention2d
def _grid_groups(P, R, C, row_major):
    at = lambda i, j: grid_rank(i, j, R, C, row_major)  # noqa: E731
    rows = [[at(i, j) for j in range(C)] for i in range(R)]
    cols = [[at(i, j) for i in range(R)] for j in range(C)]
    return rows, cols


def _row_major(pb: Problem, gpus_per_node: int | None) -> bool:
    """CPGrid's placement rule: row-major when asked for (node_aware) and the columns divide a node."""
    _, C = pb.attention2d_grid()
    return bool(pb.node_aware and gpus_per_node is not None and gpus_per_node % C == 0)


def attention2d_cost(algo: str, pb: Problem, hw: Hardware, rank: int | None = None) -> Prediction:
    """The cost-model entry of attention2d-no and -o on pb's grid (None: choose_grid's); `rank` picks a rank's
    bytes (its K, V may or may not move in the permutation), None the largest."""
    P = pb.world
    R, C = pb.attention2d_grid()
    row_major = _row_major(pb, hw.gpus_per_node)
    _, n_q, n_kv, n_r, e, acc = _sizes(pb)
    F, B = attention_flops(pb)
    rows, cols = _grid_groups(P, R, C, row_major)
    moving = [(p, grid_rank(p // C, p % C, R, C, row_major)) for p in range(P) if kv_moves(p, R, C, row_major)]
    perm_t = pairs_link(moving, hw).t(2 * n_kv * e) if moving else 0.0
    c1, c1b = F / (R * C) / hw.fwd_tflops, B / (R * C) / hw.bwd_tflops     # one (Q chunk, KV chunk) block
    mg = n_q * MERGE_BYTES / hw.mem_bw
    add_q, add_kv = n_q * ADD_BYTES / hw.mem_bw, 2 * n_kv * ADD_BYTES / hw.mem_bw
    # Forward bytes (attention2d.py / attention2d_o.py; cp_grid.attention2d_bytes).
    q_g = (C - 1) * n_q * e                       # Q gathered in the row
    kv_g = (R - 1) * 2 * n_kv * e                 # K, V gathered in the column
    overlap = algo == "attention2d-o" and overlap_pays(pb.batch * (pb.seq_len // P))   # else -O runs -NO
    w_r = wire_bytes(R - 1 if overlap else 1, e, acc)   # dK, dV partials: input dtype unless summed on the way
    fix = (C - 1) * (n_q + n_r) * acc             # AttnFix: partial (o, lse) to their owners / the o ring
    # Backward bytes.
    qdo_g = (C - 1) * 2 * n_q * e                 # Q, dO in the row
    stat_g = (C - 1) * 2 * n_r * acc              # D, lse in the row
    dq_rs = (C - 1) * n_q * acc                   # dQ partials to their owners in the row (fp32)
    dkv_rs = (R - 1) * 2 * n_kv * w_r             # dK, dV in the column
    if not overlap:
        row = phase_link(rows, hw, p2p=False) if C > 1 else None
        col = phase_link(cols, hw, p2p=False) if R > 1 else None
        tr = lambda n, calls=1: row.t(n, calls) if row else 0.0  # noqa: E731
        tc = lambda n, calls=1: col.t(n, calls) if col else 0.0  # noqa: E731
        # Line 5 in groups of n chunks (attention2d.ChunkGroups; the node-aware placement: n = 1): C / n Q groups
        # x R / n K, V groups of calls; a Q group merges R / n - 1 results of n chunks' rows, every call adds into
        # n chunks of dQ and of dK, dV; n > 1 interleaves the gathered Q, K, V (and dO, D, lse) in one copy each.
        n = 1 if row_major else group_chunks(R, C, pb.batch * (pb.seq_len // P), pb.group_tokens)
        ilv = 0.0 if n == 1 else 2 / hw.mem_bw
        # (the all-to-alls of partials are timed as the reduce-scatters they replace: same bytes, same rings)
        split = False                             # the dK, dV exchange behind the own pair's last keys
        if n == 1 and not pb.a2d_no_waits:
            # The own pair while the gathers travel, the own Q's R - 1 other pairs once K, V have landed, the rest
            # once Q has (attention2d.pair_order; the column's gather posted first, the row's timed after it).
            t_kv, t_q, t_qb = tc(kv_g), tc(kv_g) + tr(q_g), tc(kv_g) + tr(qdo_g, 2) + tr(stat_g)
            core_f = max(max(c1, t_kv) + (R - 1) * c1, t_q) + (C - 1) * R * c1
            core_b = max(max(c1b, t_kv) + (R - 1) * c1b, t_qb) + (C - 1) * R * c1b
            split = C == 1 and R > 1 and not pb.a2d_no_exchange_waits
            if split:
                # R x 1 (attention2d.own_split): the own pair's keys [:s1] (half its work) behind the gather, the
                # R - 1 other pairs, then its keys [s1:] while the partials travel.
                core_b = max(0.5 * c1b, t_kv) + (R - 1) * c1b + max(0.5 * c1b, tc(dkv_rs))
        else:
            core_f = tr(q_g) + tc(kv_g) + F / hw.fwd_tflops
            core_b = tr(qdo_g, 2) + tr(stat_g) + tc(kv_g) + B / hw.bwd_tflops
        fwd = (perm_t + core_f + C * (R // n - 1) * mg
               + ilv * (C * n_q + R * 2 * n_kv) * e
               + (tr(fix) + C * n_q * ATTNFIX_BYTES / hw.mem_bw if C > 1 else 0.0))
        bwd = (core_b + R * C // n * (add_q + add_kv)
               + ilv * ((2 * C * n_q + R * 2 * n_kv) * e + C * 2 * n_r * acc)
               + tr(dq_rs) + (0.0 if split else tc(dkv_rs)) + perm_t)
    else:
        row = phase_link(rows, hw, p2p=True) if C > 1 else None
        col = phase_link(cols, hw, p2p=True) if R > 1 else None
        tr = lambda n: row.t(n) if row and n else 0.0  # noqa: E731
        tc = lambda n: col.t(n) if col and n else 0.0  # noqa: E731

        def chain(block, msg, own_extra):
            """R blocks while R - 1 messages pass round the column, each forwarded after it arrives."""
            return overlapped([block] * (R - 1), [tc(msg)] * (R - 1)) + block + own_extra

        # Forward (Alg. 4-6): t = 0 computes the own Q block against K, V as they arrive; t >= 1 each arriving
        # Q block against all of them, its partial (o, lse) passed round the row one step behind.
        m_fix = (n_q + n_r) * acc
        t0 = max(chain(c1 + mg, 2 * n_kv * e, -mg), tr(n_q * e) if C > 1 else 0.0)
        steps = [max(R * c1 + (R - 1) * mg + (mg if t >= 2 else 0.0),
                     tr((n_q * e if t + 1 < C else 0) + (m_fix if t >= 2 else 0))) for t in range(1, C)]
        fwd = perm_t + t0 + sum(steps) + (tr(m_fix) + mg if C > 1 else 0.0)
        # Backward (Alg. 8-11): the same with (Q, dO, D, lse) round the row, dQ one step behind it, and in the
        # last pass every K, V chunk's dK, dV accumulator passed down the column.
        blk = 2 * n_q * e + 2 * n_r * acc
        per = c1b + add_q + add_kv
        t0 = max(chain(per, 2 * n_kv * e, 0.0), tr(blk) if C > 1 else 0.0)
        if C == 1:
            t0 = max(t0, chain(per, 2 * n_kv * w_r, 0.0))
        steps = []
        for t in range(1, C):
            s_t = max(R * per, tr((blk if t + 1 < C else 0) + (n_q * acc if t >= 2 else 0)))
            if t == C - 1:
                s_t = max(s_t, chain(per, 2 * n_kv * w_r, 0.0))
            steps.append(s_t)
        bwd = t0 + sum(steps) + tr(n_q * acc) + tc(2 * n_kv * w_r) + perm_t
    # The byte totals are cp_grid.attention2d_bytes' (the one formula the counters are tested against); the
    # per-phase terms above only time them.
    fwd_bytes, bwd_bytes = attention2d_bytes(seq_len=pb.seq_len, world=P, rows=R, cols=C, b=pb.batch, h=pb.heads,
                                             h_kv=pb.kv_heads, d=pb.head_dim, elem=e, acc=acc,
                                             overlap=overlap, row_major=row_major, rank=rank)
    return Prediction(algo, fwd, bwd, fwd_bytes, bwd_bytes, F, B, (R, C), row_major)


# ----------------------------------------------------------------------------------------------- public
def predict(algo: str, pb: Problem, hw: Hardware) -> Prediction:
    """Predicted forward / backward seconds, bytes and FLOPs of `algo` (an algorithm or a baseline) on `hw`."""
    row = registry.get(algo)
    if not isinstance(pb, Problem) or not isinstance(hw, Hardware):
        raise ValueError("predict(algo, problem: Problem, hardware: Hardware)")
    if not pb.feasible(algo):
        raise ValueError(f"seq_len {pb.seq_len} cannot be sharded for {algo} over {pb.world} ranks "
                         f"(its {row.layout} layout needs a multiple of {row.divisor(pb.world)})")
    hw = cost_compute.scaled(algo, pb, hw)      # the algorithm's measured local-work factor (issue 26)
    return row.predict(algo, pb, hw)


def comm_bytes(algo: str, pb: Problem, *, gpus_per_node: int | None = None, rank: int | None = None) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends in `algo`, as its CommStats counts them. Attention2D: the grid
    is placed row-major when pb.node_aware and `gpus_per_node` (CPGrid's argument) is a multiple of C; `rank`
    picks a rank (its K, V may or may not move in the permutation), None the largest."""
    row = registry.get(algo)
    if rank is not None and not 0 <= rank < pb.world:
        raise ValueError(f"rank must be in [0, {pb.world}), got {rank}")
    hw = dataclasses.replace(HARDWARE["h200-nvlink"], gpus_per_node=gpus_per_node or 1 << 20)
    pred = row.predict(algo, dataclasses.replace(pb, node_aware=pb.node_aware and gpus_per_node is not None), hw,
                       rank)
    return pred.fwd_bytes, pred.bwd_bytes


def _seconds(algo: str, pb: Problem, hw: Hardware) -> float:
    p = predict(algo, pb, hw)
    return p.total_s if pb.backward else p.fwd_s


def best_grid(algo: str, problem: Problem, hardware: Hardware) -> tuple[int, int]:
    """Attention2D's grid (R, C), R * C = P, with the smallest predicted time for `algo` on `hardware` (fwd +
    bwd, or fwd when not problem.backward): the real bytes of each grid timed over the links they cross, not
    the bytes alone (cp_grid.choose_grid, used where no hardware is known). Grids within GRID_TIME_TIE of the
    fastest count as equally fast, and of those the one sending the fewest bytes wins: where the layer is
    compute-bound every grid predicts nearly the same time (P = 16 on 8-GPU IB nodes, 128k: all five grids
    within 1.5%), and the model is not that precise (its NVLink errors are 2-20%). problem.grid, when set, is
    kept."""
    if problem.grid is not None:
        return problem.grid
    P = problem.world
    preds = {g: predict(algo, dataclasses.replace(problem, grid=g), hardware)
             for g in [(r, P // r) for r in range(1, P + 1) if P % r == 0]}
    secs = {g: p.total_s if problem.backward else p.fwd_s for g, p in preds.items()}
    fastest = min(secs.values())
    near = [g for g in preds if secs[g] <= fastest * (1 + GRID_TIME_TIE)]
    return min(near, key=lambda g: (preds[g].fwd_bytes + preds[g].bwd_bytes, secs[g]))


GRID_TIME_TIE = 0.05
"""Relative predicted-time difference below which best_grid prefers fewer bytes to a faster prediction."""


ALGO_TIME_TIE = 0.01
"""Relative predicted-time difference below which choose_algo counts two algorithms as equally fast. Where the layer
is compute-bound the candidates' predictions differ by less than the model's error: at P = 2 over NVLink (128k, 16
heads) all seven lie within 0.6 % while the model misses the measured times by 5-13 % (the `measured` table of
`cost-model`), and refitting the compute factors on 2026-11-29 (Attention2D-NO's 1.006 at P = 4 became 1.002)
moved the smallest prediction from burst to Attention2D-NO, the slowest there on 2 x H200 (0.523x one GPU against
0.506-0.519x, twenty-ninth session)."""


def choose_algo(problem: Problem, hardware: Hardware, candidates=None) -> tuple[str, dict[str, float]]:
    """The candidate (None: every algorithm of algos/registry.py) with the smallest predicted time (fwd + bwd, or
    fwd when not problem.backward), and every feasible candidate's prediction in seconds; a grid algorithm on
    its `best_grid` (the caller runs it there). Candidates within ALGO_TIME_TIE of the smallest count as tied, and
    of those the earliest in the candidates' order wins (the registry's: ring first, the most measured)."""
    cands = registry.names() if candidates is None else tuple(candidates)
    if not cands:
        raise ValueError("choose_algo: candidates is empty")
    for a in cands:
        if a not in registry.names():
            raise ValueError(f"candidates must be among {registry.names()}, got {a!r}")
    times = {}
    for a in cands:
        if problem.feasible(a):
            pb = dataclasses.replace(problem, grid=best_grid(a, problem, hardware)) if registry.get(a).grid else problem
            t = _seconds(a, pb, hardware)
            if t < float("inf"):                # inf: the heads cannot be split (ulysses; collective.py)
                times[a] = t
    if not times:
        raise ValueError(f"seq_len {problem.seq_len} cannot be sharded over {problem.world} ranks by any of {cands}")
    fastest = min(times.values())
    best = min((a for a in times if times[a] <= fastest * (1 + ALGO_TIME_TIE)), key=cands.index)
    return best, times
