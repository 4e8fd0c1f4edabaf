"""The context-parallel grid (Attention2D, ulysses-ring): rank placement on an R x C grid, the default grid, the
caps on one grouped kernel call's query tokens, when Attention2D-O's overlap pays, and Attention2D's byte formula
(the one the counters and the cost model are tested against). Process groups are built here (`CPGrid`, `get_grid`);
the collectives that run over them are comm.py's. torch.distributed is reached as `comm.dist`, as everywhere in the
algorithms, so that the rank benchmark's replay (bench/_replay_comm.py) stands in for it here too.
"""
from __future__ import annotations

import copy
import math

from . import comm
from .comm import wire_bytes


def grid_position(p: int, rows: int, cols: int, row_major: bool) -> tuple[int, int]:
    """Grid position (i, j) of group rank p (see CPGrid)."""
    return (p // cols, p % cols) if row_major else (p % rows, p // rows)


def grid_rank(i: int, j: int, rows: int, cols: int, row_major: bool) -> int:
    """The group rank at grid position (i, j)."""
    return i * cols + j if row_major else i + j * rows


def kv_moves(p: int, rows: int, cols: int, row_major: bool) -> bool:
    """Whether group rank p's K, V leave it in the column-major -> row-major permutation: they go to the
    position (p // cols, p % cols), whose row-major index is p."""
    return grid_rank(p // cols, p % cols, rows, cols, row_major) != p


def attention2d_bytes(*, seq_len: int, world: int, rows: int, cols: int, b: int, h: int, h_kv: int, d: int,
                      elem: int = 2, overlap: bool = False, row_major: bool = False,
                      rank: int | None = None, acc: int = 4) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends in Attention2D on a rows x cols grid: the paper's Section 3.3
    per-rank costs with our choices made explicit. s = seq_len / world tokens per rank, n_q = b s h d,
    n_kv = b s h_kv d, n_r = b h s (one statistic per query row), e = `elem`, statistics (lse, D) in `acc`
    bytes (4: fp32; 8 for fp64 inputs, as kernels.local_attn.acc_dtype); collectives as rings (an all-gather,
    a reduce-scatter or an all-to-all over g ranks sends g - 1 chunks):
      permutation (Alg. 1 line 2, Alg. 3 line 9): 2 n_kv e each way for a rank whose K, V move (`rank`;
                 None: a rank that moves, if any does), 0 for the others
      forward:  Q gather (C-1) n_q e; K, V gather (R-1) 2 n_kv e; AttnFix: the normalized partial outputs
                and their lse in fp32, (C-1) (n_q + n_r) 4
      backward: Q, dO gather (C-1) 2 n_q e; D, lse (C-1) 2 n_r 4 (D replaces the paper's O); K, V gather
                (R-1) 2 n_kv e; dQ partials (C-1) n_q 4; dK, dV partials (R-1) 2 n_kv w_R
    where w_R = `wire_bytes`: e for Attention2D-NO (an all-to-all, summed at the owner) and for Attention2D-O's
    (`overlap`) column ring of one hop (R = 2), acc for its longer rings, which sum on the way. o and dQ
    partials stay fp32 (docs/design.md, wire precision, rule 3). Attention2D-O on shards that `overlap_pays` does
    not take runs Attention2D-NO: its bytes."""
    s = seq_len // world
    overlap = overlap and overlap_pays(b * s)
    n_q, n_kv, n_r = b * s * h * d, b * s * h_kv * d, b * h * s
    ranks = range(world) if rank is None else [rank]
    moves = any(kv_moves(p, rows, cols, row_major) for p in ranks)
    perm = 2 * n_kv * elem if moves else 0
    w_r = wire_bytes(rows - 1 if overlap else 1, elem, acc)
    fwd = perm + (cols - 1) * (n_q * elem + (n_q + n_r) * acc) + (rows - 1) * 2 * n_kv * elem
    bwd = perm + (cols - 1) * (2 * n_q * elem + 2 * n_r * acc + n_q * acc) + (rows - 1) * 2 * n_kv * (elem + w_r)
    return fwd, bwd


def choose_grid(world: int, *, h: int = 1, h_kv: int = 1) -> tuple[int, int]:
    """(rows, cols) for `world` ranks: the square when world is a perfect square, else the factorisation that
    minimises per-rank bytes for the heads (K, V are h / h_kv times smaller than Q, so GQA favours more rows)."""
    r = int(round(world ** 0.5))
    if r * r == world:
        return r, r
    cands = [(x, world // x) for x in range(1, world + 1) if world % x == 0]
    cost = lambda rc: sum(attention2d_bytes(seq_len=world, world=world, rows=rc[0], cols=rc[1], b=1, h=h,  # noqa
                                            h_kv=h_kv, d=128))
    return min(cands, key=lambda rc: (cost(rc), rc[0]))


GROUP_TOKENS = (32768, 16384)
"""The caps on query tokens (b x rows) one grouped Attention2D kernel call may take (`group_chunks`, `batch_chunks`),
largest first. Larger calls are faster locally: replayed on one H200 (2026-11-28, two runs a cap in the order
16384, 32768, 32768, 16384, docs/results/group_tokens_ab_s25/) 32768 took Attention2D-NO's rank from 986-994 to
929-931 ms at 1M over 8 x 8 (64 kernel calls a pass to 16) and from 61.7-65.9 to 60.2-61.7 ms at 128k over 4 x 4
(ring 57 ms). But grouping costs two things:
  memory   a call's output, gradients and workspace grow with its rows (the planner counts n times a pair
           call's): at 32768 GPT-3 13B at 128k on 16 80-GB GPUs (4 x 4, 8k tokens a rank) needs 1.87 GiB more,
           which would move it from fsdp-optim_grads_params (74.17 GiB) to +recompute;
  overlap  where every chunk pair is a call of its own (n = 1), the rank computes its own pairs while the gathers
           travel (attention2d.pair_order); grouped calls wait for the gathers. At 16k tokens a rank 16384 keeps
           n = 1 and 32768 would group 2 chunks: the cost model puts that overlap at 4-6 % of 1M over P = 64
           (h200-nvlink, h100-ib, h100-eth), about what the larger calls save locally; no run here has had the
           64 GPUs to measure it.
So the default (`group_chunks(..., cap=None)`) takes the largest cap, except that shards the smallest cap leaves
ungrouped stay ungrouped (1M over 8 x 8: one pair a call, as before; 128k over 4 x 4: 4 chunks a call instead of
2), and the memory planner lowers a run to the smallest where that does not fit (cost/memory.py `fit`;
`--cp-group-tokens` fixes a cap, which is then taken as it is). Groups are made smaller (more calls) to stay
within the cap, down to one chunk pair per call, whatever its size."""


def check_group_tokens(value, what: str = "--cp-group-tokens") -> int | None:
    """`value` as a group cap (a positive number of query tokens, or None: the default rule), else ValueError naming
    `what`."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{what} must be a positive number of query tokens (e.g. {GROUP_TOKENS[-1]}), got {value!r}")
    return value


def _by_rule(within, cap: int | None) -> int:
    """within(cap), the chunks a call takes under `cap`; cap None: GROUP_TOKENS' default rule, the largest cap's,
    but 1 where the smallest cap's is 1 (those shards keep one chunk pair a call)."""
    if cap is not None:
        return within(cap)
    return 1 if within(GROUP_TOKENS[-1]) == 1 else within(GROUP_TOKENS[0])


def group_chunks(rows: int, cols: int, tokens: int, cap: int | None = None) -> int:
    """Attention2D-NO's chunks per kernel call (algos/attention2d.py, `chunk_groups`) on an R x C grid, column-major
    placement, for shards of `tokens` (b x s): the largest divisor n of gcd(R, C) (T = P / n, a multiple of
    lcm(R, C), splits both the row's Q chunks, residues i + cR, and the column's K, V chunks, residues j + rC) with
    n x tokens <= `cap`, else 1; cap None: GROUP_TOKENS' default rule (the largest cap, but ungrouped where the
    smallest leaves the chunks ungrouped). A square grid is then one call per rank (n = R = C: the paper's one
    FlashAttn of line 5) while R s tokens fit, an R x C grid with R = kC (or C = kR) k calls of n = min(R, C)."""
    g = math.gcd(rows, cols)
    return _by_rule(lambda c: max([n for n in range(1, g + 1) if g % n == 0 and n * tokens <= c], default=1), cap)


def batch_chunks(rows: int, tokens: int, cap: int | None = None) -> int:
    """Attention2D-O's chunks per batched call of its middle passes (`attention2d_o.batch_cap`) on R = rows grid rows
    for shards of `tokens` (b x s): cap // tokens, at least 1, at most R; cap None: GROUP_TOKENS' default rule (as
    group_chunks: none batched where the smallest cap batches none)."""
    return _by_rule(lambda c: min(rows, max(1, c // max(1, tokens))), cap)


OVERLAP_MIN_LOCAL = 8192
"""Attention2D-O overlaps its rings with its compute on shards of more than this many tokens (b x s); shorter ones
run Attention2D-NO's schedule (`overlap_pays`). Why: at 2k tokens a rank (128k over 8 x 8) one (Q block, K, V chunk)
pair is ~70 us of forward compute on an H100 and a ring hop ~0.2 ms of host time (a p2p post, a kernel call, a
merge), so the rank is bound by launches: replayed on one H100 (2026-11-27), Attention2D-O took 2.2-2.5x the ideal
in 48-63 kernel calls a fwd+bwd, 2.2-2.4x with its column gathered at once and one call a pass (16 calls, the ring
round the row kept), against Attention2D-NO's 1.16-1.23x in 2 (docs/performance.md). At 8k (128k over P = 16) the
overlap would hide its hops, but its local work costs more than they do: replayed on one H100 (2026-11-28, two runs
each, `docs/results/a2do_8k_ab_s23/`) its own schedule took 72.6-73.0 ms a fwd+bwd (MHA 32/32; GQA 32/8 68.9-70.0),
-NO's 67.3-68.1 (62.8-63.6), ring 62.0-62.2: the R x C fp32 read-modify-writes of every chunk's dK, dV, its rings'
fp32 accumulators and 8k-token triangles. The cost model (`cost-model --table scale`) has -NO ahead of -O at 128k
P = 16 wherever either beats ring-te. At 16k (1M over P = 64) the overlapped schedule keeps its rings: locally
level with -NO's (1.07-1.10x the ideal each, 2026-11-28), ahead on 2026-11-25 (1.13-1.14x against 1.15-1.16x)."""


def overlap_pays(tokens: int) -> bool:
    """Whether Attention2D-O runs its own overlapped schedule on shards of `tokens` (b x s), OVERLAP_MIN_LOCAL."""
    return tokens > OVERLAP_MIN_LOCAL


class CPGrid:
    """P = rows x cols ranks of a context-parallel group seen as a grid (Attention2D).

    Group rank p sits at grid position (i, j): column-major (i = p % rows, j = p // rows), as in the paper, or,
    when `gpus_per_node` is given and cols divides it, row-major (i = p // cols, j = p % cols), so that every
    grid row (the Q gathers and the partial reduce-scatter, the bulk of the traffic) stays inside one node.
    Tokens are cyclic over group ranks in both cases (token t on group rank t mod P).
    `row` and `col` are process groups over the rank's grid row and column, created with local
    synchronisation, so only their members take part; every rank of `group` must build its grid.
    `group_tokens`: the most query tokens one grouped kernel call takes (GROUP_TOKENS; None: its default rule;
    `with_group_tokens`).
    """

    def __init__(self, group, rows: int, cols: int, gpus_per_node: int | None = None,
                 group_tokens: int | None = None):
        self.group_tokens = check_group_tokens(group_tokens, "group_tokens")
        world = comm.dist.get_world_size(group)
        if rows < 1 or cols < 1 or rows * cols != world:
            raise ValueError(f"grid: rows x cols = {rows} x {cols} must equal the group size {world}")
        if gpus_per_node is not None and gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be a positive integer, got {gpus_per_node}")
        self.group, self.rows, self.cols, self.world = group, rows, cols, world
        self.row_major = gpus_per_node is not None and gpus_per_node % cols == 0
        self.rank = comm.dist.get_rank(group)
        self.i, self.j = self.position(self.rank)
        glob = lambda p: comm.dist.get_global_rank(group, p)  # noqa: E731
        self.row_ranks = [self.at(self.i, c) for c in range(cols)]     # group ranks, in column order
        self.col_ranks = [self.at(r, self.j) for r in range(rows)]     # group ranks, in row order
        # Both placements list a row by column and a column by row in increasing rank order, which is the
        # order new_group gives its members, so chunk c of a row gather is column c's (and r of a column's, row r's).
        for members in (self.row_ranks, self.col_ranks):
            assert [glob(p) for p in members] == sorted(glob(p) for p in members)
        sub = lambda ranks: comm.dist.new_group([glob(p) for p in ranks], use_local_synchronization=True)  # noqa: E731
        self.row = sub(self.row_ranks) if cols > 1 else None
        self.col = sub(self.col_ranks) if rows > 1 else None

    def position(self, p: int) -> tuple[int, int]:
        return grid_position(p, self.rows, self.cols, self.row_major)

    def with_group_tokens(self, cap: int | None) -> "CPGrid":
        """This grid (its process groups shared, none created) with another group cap."""
        if cap == self.group_tokens:
            return self
        out = copy.copy(self)
        out.group_tokens = check_group_tokens(cap, "group_tokens")
        return out

    def at(self, i: int, j: int) -> int:
        """The group rank at grid position (i, j)."""
        return grid_rank(i, j, self.rows, self.cols, self.row_major)

    def kv_owner(self, i: int, j: int) -> int:
        """Residue (mod P) of the K, V tokens that position (i, j) holds after the column-major -> row-major
        permutation (Alg. 1, line 2): i * cols + j, so a grid column's K, V are the tokens = j (mod cols)."""
        return i * self.cols + j


_GRIDS: dict = {}


def get_grid(group, shape: tuple[int, int] | None = None, *, h: int = 1, h_kv: int = 1,
             gpus_per_node: int | None = None, group_tokens: int | None = None) -> CPGrid:
    """The CPGrid over `group` with `shape` (rows, cols), or `choose_grid`'s for the heads when None, and the group
    cap `group_tokens` (None: GROUP_TOKENS' default rule); its process groups are built once per (group, shape,
    placement) and reused, since building them is collective (every rank of `group` must make the first call for a
    given key together)."""
    rows, cols = shape or choose_grid(comm.dist.get_world_size(group), h=h, h_kv=h_kv)
    key = (group, rows, cols, gpus_per_node)
    if key not in _GRIDS:
        _GRIDS[key] = CPGrid(group, rows, cols, gpus_per_node)
    return _GRIDS[key].with_group_tokens(group_tokens)
