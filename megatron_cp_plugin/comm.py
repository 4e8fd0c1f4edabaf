"""Communication shared by the algorithms: the ring send/recv, byte counters, group checks.

Every call takes its process group explicitly (`group=None` is the default group); nothing here keeps
global process-group state.
"""
from __future__ import annotations

import copy
import datetime
import math

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """Bytes this rank sent, per phase. Pass one as `comm_stats=` to count an algorithm's traffic; it adds
    to the counters on every call (forward and backward), so one object can sum a whole step."""

    forward_bytes: int = 0
    """Bytes sent by this rank in forward passes."""
    backward_bytes: int = 0
    """Bytes sent by this rank in backward passes."""

    def add(self, phase: str, nbytes: int) -> None:
        setattr(self, f"{phase}_bytes", getattr(self, f"{phase}_bytes") + nbytes)


def resolve_group(group):
    """`group` (or a CPGrid's group) or the default group; ValueError (raised before any collective) when
    this rank is not in it."""
    if isinstance(group, CPGrid):
        group = group.group
    if not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised (call init_process_group first)")
    group = dist.group.WORLD if group is None else group
    if dist.get_rank(group) < 0:
        raise ValueError("group: this process is not a member of the given process group")
    return group


def group_size(group) -> int:
    """The members of `group` (through this module's torch.distributed, which the rank replay stands in for)."""
    return dist.get_world_size(group)


def group_rank(group) -> int:
    """This process's rank in `group` (as group_size)."""
    return dist.get_rank(group)


class Exchange:
    """Point-to-point messages among the members of `group`, asynchronously: `post(sends, recvs)` posts one batch
    (sends: (group rank, tensors) pairs, recvs: (group rank, contiguous destination tensors) pairs; NCCL runs it on
    its own stream while the caller computes), `wait()` makes the current stream wait for it. Every member posts
    its batches in the same order, and a batch's messages pair up with the peers' (ring attention's rounds: each
    rank sends its own K, V to the next g ranks and receives those of the previous g)."""

    def __init__(self, group, phase: str, stats: CommStats | None = None):
        self.group, self.phase, self.stats = group, phase, stats
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        # the members' global ranks, looked up once: torch's get_global_rank scans the group's rank map at every
        # call, and a round at P = 64 posts 128 messages (ring.post_round)
        self._global = dist.get_process_group_ranks(group)
        # gloo's send/recv take host tensors only ("writev: Bad address" on CUDA ones): with CUDA tensors on a
        # gloo group (ranks sharing a GPU, devices.py) each message is staged through host memory.
        self._staged = dist.get_backend(group) == "gloo"
        self._works: list = []
        self._landing: list = []

    def post(self, sends, recvs) -> None:
        sends = [(p, [t if t.is_contiguous() else t.contiguous() for t in ts]) for p, ts in sends]
        wire_sends, wire_recvs = sends, recvs
        if self._staged and any(t.is_cuda for _, ts in sends for t in ts):
            wire_sends = [(p, [t.cpu() for t in ts]) for p, ts in sends]        # synchronous: final when sent
            wire_recvs = [(p, [torch.empty(t.shape, dtype=t.dtype) for t in ts]) for p, ts in recvs]
            self._landing += [(h, d) for (_, hs), (_, ds) in zip(wire_recvs, recvs) for h, d in zip(hs, ds)]
        glob = self._global
        ops = [dist.P2POp(dist.isend, t, glob[p], self.group) for p, ts in wire_sends for t in ts]
        ops += [dist.P2POp(dist.irecv, t, glob[p], self.group) for p, ts in wire_recvs for t in ts]
        if ops:
            self._works += dist.batch_isend_irecv(ops)
        if self.stats is not None:
            self.stats.add(self.phase, sum(t.numel() * t.element_size() for p, ts in sends for t in ts
                                           if p != self.rank))

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works = []
        for host, dev in self._landing:                          # staged: the received bytes onto the device
            dev.copy_(host)
        self._landing = []


class Ring(Exchange):
    """Send to the next rank of `group` and receive from the previous one, asynchronously.

    `send_recv(tensors)` posts one batch (so NCCL runs it on its own stream while the caller computes) and
    returns the receive buffers; `wait()` makes the current stream wait for the batch. Several rings may be
    in flight at once (ring attention's K,V and dK,dV); every rank must post them in the same order.
    """

    def send_recv(self, tensors) -> list[torch.Tensor]:
        send = [t.contiguous() for t in tensors]
        recv = [torch.empty_like(t) for t in send]
        self.post([((self.rank + 1) % self.world, send)], [((self.rank - 1) % self.world, recv)])
        return recv


# ----------------------------------------------------------------------------------------------- CP grid
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


def wire_bytes(hops: int, elem: int, acc: int) -> int:
    """Element size of a partial sum on the wire (the wire-precision policy, docs/design.md): the input
    dtype's when it is summed once, at its owner (one hop, or an all-to-all); the accumulator's when it is
    summed again on its way (a ring reduce-scatter of more than one hop), so no sum is rounded twice."""
    return elem if hops <= 1 else acc


def wire_dtype(hops: int, dtype: torch.dtype, acc: torch.dtype) -> torch.dtype:
    """`wire_bytes` as a dtype: what a partial sum made of the input dtype's kernel results travels in round a ring of
    `hops` hops (Attention2D-O's column ring; ring's dK, dV and burst's dQ accumulators at P = 2, one hop)."""
    return dtype if hops <= 1 else acc


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
        world = dist.get_world_size(group)
        if rows < 1 or cols < 1 or rows * cols != world:
            raise ValueError(f"grid: rows x cols = {rows} x {cols} must equal the group size {world}")
        if gpus_per_node is not None and gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be a positive integer, got {gpus_per_node}")
        self.group, self.rows, self.cols, self.world = group, rows, cols, world
        self.row_major = gpus_per_node is not None and gpus_per_node % cols == 0
        self.rank = dist.get_rank(group)
        self.i, self.j = self.position(self.rank)
        glob = lambda p: dist.get_global_rank(group, p)  # noqa: E731
        self.row_ranks = [self.at(self.i, c) for c in range(cols)]     # group ranks, in column order
        self.col_ranks = [self.at(r, self.j) for r in range(rows)]     # group ranks, in row order
        # Both placements list a row by column and a column by row in increasing rank order, which is the
        # order new_group gives its members, so chunk c of a row gather is column c's (and r of a column's, row r's).
        for members in (self.row_ranks, self.col_ranks):
            assert [glob(p) for p in members] == sorted(glob(p) for p in members)
        sub = lambda ranks: dist.new_group([glob(p) for p in ranks], use_local_synchronization=True)  # noqa: E731
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


# ----------------------------------------------------------------------------------------------- collectives
# Byte counts are what one rank sends: an all-gather (as a ring, what NCCL uses at these sizes) or an all-to-all
# among g ranks sends (g - 1) chunks; a permutation step one chunk, or none for a rank that keeps its own.
# torch 2.13 renamed all_gather_into_tensor (all_gather_single); 2.11 (the GPU image) has only the old name.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


_HELD_WORK: dict = {}


def run_collective(op, *args, group=None, **kw):
    """`op(*args, group=group, **kw)` (a torch.distributed collective), waited for. On CPU (gloo) the finished
    work stays referenced here until the group's next collective. Gloo runs a collective on a worker thread that
    drops its own reference to the work just after the caller resumes, and with it maybe the last one to the
    tensors, a release that takes the GIL; a script that ended right after its last collective raced that
    release against interpreter finalization, where a thread that asks for the GIL is ended by pthread_exit,
    whose unwind through a noexcept destructor calls std::terminate: SIGABRT at exit, "terminate called without
    an active exception" (issue 29; tests/exit_check.py). Held here, the work is freed by the thread that
    replaces or clears the entry, which holds the GIL."""
    start_collective(op, *args, group=group, **kw).wait()


class Posted:
    """A collective posted and not yet waited for (`start_collective`): `wait()` once before reading what it writes.
    Holds the work and its tensors until then; after it, as run_collective does (its CPU exit safety)."""

    def __init__(self, work, group, cpu: bool, tensors=()):
        self.work, self.group, self.cpu, self.tensors = work, group, cpu, tensors

    def wait(self) -> None:
        if self.work is None:
            return
        self.work.wait()
        if self.cpu:
            _HELD_WORK[self.group] = self.work
        self.work = self.tensors = None


def start_collective(op, *args, group=None, **kw) -> Posted:
    """`op(*args, group=group, async_op=True, **kw)`, not waited for: the caller computes while it runs (on NCCL its
    own stream; `wait()` makes the current stream wait for it)."""
    work = op(*args, group=group, async_op=True, **kw)
    first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
    return Posted(work, group, first.device.type == "cpu", args)


def _count(stats, phase, nbytes):
    if stats is not None:
        stats.add(phase, int(nbytes))


def all_gather(group, x: torch.Tensor, stats=None, phase="forward") -> torch.Tensor:
    """[g, *x.shape]: every member's x, in group-rank order (x itself when group is None)."""
    out, posted = all_gather_start(group, x, stats, phase)
    posted.wait()
    return out


def all_gather_start(group, x: torch.Tensor, stats=None, phase="forward") -> tuple[torch.Tensor, Posted]:
    """all_gather posted: (out, posted); read out (its own row included, which the collective writes) only after
    posted.wait(). The caller computes with its own x while the others arrive."""
    if group is None:
        return x.unsqueeze(0), Posted(None, None, False)
    g = dist.get_world_size(group)
    out = torch.empty((g,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    flat = x.contiguous().view(-1)
    posted = start_collective(_ALL_GATHER, out.view(-1), flat, group=group)        # 1-D: gloo wants that
    _count(stats, phase, (g - 1) * x.numel() * x.element_size())
    return out, posted


def all_to_all(group, parts, stats=None, phase="forward", recv=None) -> list:
    """One all-to-all of several tensors of any dtypes (fp32 lse beside bf16 outputs): chunk c of each part goes to
    member c; returns each part with chunk c from member c (`parts` itself when group is None).

    Equal chunks: each part a tensor [g, ...] (any strides: a strided part is copied into the send buffer once,
    a lone contiguous part is sent as it is), returned as one, a view of the receive buffer (strided where several
    parts share it; a copy only where a part's bytes are not aligned for its dtype). Unequal chunks (ulysses' K, V
    heads where members read different numbers of them): a part may instead be a list of g tensors of one dtype
    (chunk c for member c), and `recv[i]` the g shapes of the chunks part i receives (None: the shape it sends, for
    a tensor part); such a part comes back as a list. Unequal chunks travel as they are, with all_to_all_single's
    split sizes: padding them to the largest would send bytes for nothing, while split sizes cost nothing (torch
    runs the equal-split all-to-all on NCCL as the same one send and one receive per peer)."""
    return all_to_all_start(group, parts, stats, phase, recv).wait()


class PostedAllToAll:
    """An all_to_all posted and not yet waited for (`all_to_all_start`): `wait()` returns what all_to_all returns."""

    def __init__(self, posted: Posted | None, unpack):
        self.posted, self.unpack = posted, unpack

    def wait(self) -> list:
        if self.posted is not None:
            self.posted.wait()
        unpack, self.unpack = self.unpack, None                     # once: the receive buffer goes with it
        return unpack()

    def then(self, fn) -> PostedAllToAll:
        """The same collective, whose wait() returns fn(what this one's wait() returns): the caller's own unpacking,
        after which the receive buffer goes as well."""
        return PostedAllToAll(None, lambda: fn(self.wait()))


def send_buffer(g: int, specs, device) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """(packed, views): one all_to_all send buffer of g members' bytes for parts of `specs` [(dtype, shape), ...]
    (shape [g, ...]: member c's chunk at [c]), and a typed view of it per part, for a caller that writes each part
    in place (e.g. rows taken in another order, without an intermediate tensor) and posts
    `all_to_all_start(group, views, packed=packed)`. views is None where a part's bytes would not be aligned for its
    dtype (mixed element sizes): then the caller builds the parts as tensors."""
    sizes = [torch.Size(shape[1:]).numel() * dt.itemsize for dt, shape in specs]
    packed = torch.empty((g, sum(sizes)), dtype=torch.uint8, device=device)
    views, at = [], 0
    for (dt, shape), n in zip(specs, sizes):
        v = _typed(packed, at, n, dt, shape)
        if v is None:
            return packed, None
        views.append(v)
        at += n
    return packed, views


def all_to_all_start(group, parts, stats=None, phase="forward", recv=None, packed=None) -> PostedAllToAll:
    """all_to_all posted: the send buffer is packed and the collective started (on NCCL its own stream), and
    `wait()` returns the parts as all_to_all does. The caller computes while it travels (ulysses' head chunks).
    `packed`: the parts are the views of this buffer that `send_buffer` gave, already written: sent as is."""
    if recv is None and all(isinstance(t, torch.Tensor) for t in parts):
        if group is None:
            return PostedAllToAll(None, lambda: [t.contiguous() for t in parts])
        g = dist.get_world_size(group)
        sizes = [t[0].numel() * t.element_size() for t in parts]
        if packed is not None:
            flat = packed
        elif len(parts) == 1 and parts[0].is_contiguous():
            flat = parts[0].view(g, -1).view(torch.uint8)                        # no copy: the bytes as they are
        elif all(t.is_contiguous() for t in parts):
            flat = torch.cat([t.view(g, -1).view(torch.uint8) for t in parts], dim=1)   # bytes side by side
        else:                                       # strided parts (a permuted view): each copied in once, in place
            flat = torch.empty((g, sum(sizes)), dtype=torch.uint8, device=parts[0].device)
            at = 0
            for t, n in zip(parts, sizes):
                dst = _typed(flat, at, n, t.dtype, t.shape)
                if dst is None:
                    flat[:, at:at + n] = t.contiguous().view(g, -1).view(torch.uint8)
                else:
                    dst.copy_(t)
                at += n
        out = torch.empty_like(flat)
        posted = start_collective(dist.all_to_all_single, out, flat, group=group)
        _count(stats, phase, (g - 1) * flat[0].numel())
        shapes = [(t.dtype, t.shape) for t in parts]                 # not the parts: their memory may go now

        def unpack():
            res, at = [], 0
            for (dt, shape), n in zip(shapes, sizes):
                # Each part a view of the receive buffer where its bytes are aligned for its dtype (no copy).
                x = _typed(out, at, n, dt, shape)
                res.append(x if x is not None else out[:, at:at + n].contiguous().view(dt).view(shape))
                at += n
            return res
        return PostedAllToAll(posted, unpack)
    recv = recv or [None] * len(parts)
    if group is None:
        return PostedAllToAll(None, lambda: [p if r is None else list(p) for p, r in zip(parts, recv)])
    g, me = dist.get_world_size(group), dist.get_rank(group)
    dtypes = [p[0].dtype for p in parts]
    shapes = [[tuple(p[0].shape)] * g if r is None else [tuple(x) for x in r] for p, r in zip(parts, recv)]
    if packed is not None:                          # member c's bytes, part by part, are row c: sent as they are
        send, split_in = packed.view(-1), [packed.shape[1]] * g
    else:
        raw = lambda t: t.contiguous().view(-1).view(torch.uint8)  # noqa: E731
        chunks = [torch.cat([raw(p[c]) for p in parts]) for c in range(g)]     # member c's bytes, part by part
        send, split_in = torch.cat(chunks), [x.numel() for x in chunks]
    nbytes = [[torch.Size(s[c]).numel() * dt.itemsize for c in range(g)] for s, dt in zip(shapes, dtypes)]
    split_out = [sum(n[c] for n in nbytes) for c in range(g)]
    out = torch.empty(sum(split_out), dtype=torch.uint8, device=send.device)
    posted = start_collective(dist.all_to_all_single, out, send, split_out, split_in, group=group)
    _count(stats, phase, sum(split_in) - split_in[me])

    n_parts = len(parts)

    def unpack():
        got = [[] for _ in range(n_parts)]
        at = 0
        for c in range(g):
            for i, (dt, s) in enumerate(zip(dtypes, shapes)):
                x = out[at:at + nbytes[i][c]]
                got[i].append((x if at % dt.itemsize == 0 else x.clone()).view(dt).view(s[c]))  # aligned
                at += nbytes[i][c]
        return [torch.stack(x) if r is None else x for x, r in zip(got, recv)]
    return PostedAllToAll(posted, unpack)


def _typed(buf: torch.Tensor, at: int, n: int, dtype: torch.dtype, shape):
    """Columns at .. at + n of the byte buffer buf [g, row] as a tensor of that dtype and shape (a strided view), or
    None where the bytes are not aligned for the dtype."""
    e = dtype.itemsize
    if at % e or buf.shape[1] % e or buf.storage_offset() % e:
        return None
    return buf[:, at:at + n].view(dtype).view(shape)


def reduce_at_owner(group, x: torch.Tensor, me: int, wire: torch.dtype, stats=None, phase="backward"):
    """Sum over members of x [g, ...] (x's dtype: the accumulator's), chunk `me` (this rank's index in the
    group) kept: each member's partial travels once, in `wire`, and is summed here in x's dtype; the own
    partial is never rounded. What a reduce-scatter computes, in half the bytes for bf16 partials. x may be a
    strided view (all_to_all packs it)."""
    if group is None:
        return x[0]
    # A strided x is cast (or copied) straight into a contiguous send buffer: one pass.
    posted = all_to_all_start(group, [x.to(wire, memory_format=torch.contiguous_format)], stats, phase)
    if wire == x.dtype:                          # the own chunk came back as sent: x[me], unrounded
        return posted.wait()[0].sum(0)
    return PostedReduce(posted, me, x.dtype).wait(x[me])


class PostedReduce:
    """reduce_at_owner posted before the own partial is final (`reduce_at_owner_start`): wait(own) sums the others'
    partials, as they arrive, with `own`, this rank's final partial (x[me])."""

    def __init__(self, posted: PostedAllToAll, me: int, dtype: torch.dtype):
        self.posted, self.me, self.dtype = posted, me, dtype

    def wait(self, own: torch.Tensor) -> torch.Tensor:
        """The others' partials summed in x's dtype as they are read (no upcast copy), then `own`, unrounded (the
        chunk that travelled to itself is dropped: rounded to the wire, and unfinished where posted early)."""
        (got,) = self.posted.wait()
        got[self.me].zero_()
        return torch.sum(got, 0, dtype=self.dtype).add_(own)


def reduce_at_owner_start(group, x: torch.Tensor, me: int, wire: torch.dtype, stats=None,
                          phase="backward") -> PostedReduce:
    """reduce_at_owner, posted while x[me] is still being summed into: the other chunks (final) travel now, in
    `wire`, and the rank computes its own partial meanwhile; `.wait(x[me])` returns the sum. The same bytes and
    the same sum as reduce_at_owner's in the 16-bit case (the own partial added last, unrounded); x is always
    copied into the send buffer, so later writes to x[me] never race the transfer."""
    send = torch.empty(x.shape, dtype=wire, device=x.device)
    send.copy_(x)
    return PostedReduce(all_to_all_start(group, [send], stats, phase), me, x.dtype)


def permute(group, x: torch.Tensor, send_to: int, recv_from: int, stats=None, phase="forward") -> torch.Tensor:
    """One step of a permutation of the members' x: send x to group rank `send_to`, return the x of
    `recv_from`. An all-to-all with one nonzero split per rank, so every member takes part (NCCL wants that
    from the first operation on a group); a rank that keeps its own x sends nothing."""
    g, me = dist.get_world_size(group), dist.get_rank(group)
    x = x.contiguous()
    out = torch.empty_like(x)
    split_in = [x.shape[0] if r == send_to else 0 for r in range(g)]
    split_out = [x.shape[0] if r == recv_from else 0 for r in range(g)]
    run_collective(dist.all_to_all_single, out, x, split_out, split_in, group=group)
    if send_to != me:
        _count(stats, phase, x.numel() * x.element_size())
    return out


_GRIDS: dict = {}


def get_grid(group, shape: tuple[int, int] | None = None, *, h: int = 1, h_kv: int = 1,
             gpus_per_node: int | None = None, group_tokens: int | None = None) -> CPGrid:
    """The CPGrid over `group` with `shape` (rows, cols), or `choose_grid`'s for the heads when None, and the group
    cap `group_tokens` (None: GROUP_TOKENS' default rule); its process groups are built once per (group, shape,
    placement) and reused, since building them is collective (every rank of `group` must make the first call for a
    given key together)."""
    rows, cols = shape or choose_grid(dist.get_world_size(group), h=h, h_kv=h_kv)
    key = (group, rows, cols, gpus_per_node)
    if key not in _GRIDS:
        _GRIDS[key] = CPGrid(group, rows, cols, gpus_per_node)
    return _GRIDS[key].with_group_tokens(group_tokens)


def serve_store(timeout_s: float = 300.0) -> dist.TCPStore:
    """A rendezvous store this process serves on a port the OS picks (`.port`), bound for as long as the object
    lives: the launcher's spawned ranks, the demo's and the tests' pools join it with `init_group(port=...)`, and
    a lone rank uses one of its own. Picking a free port, closing it and letting a rank bind it later raced with
    every other process on the machine (EADDRINUSE in test_checkpoint with 20 pytest workers on 2 x H200; two
    jobs of a user on one node can do the same); a port that is never released cannot be taken."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def init_group(backend: str, rank: int, world: int, port: int | None = None, timeout_s: float = 300.0,
               **kwargs) -> None:
    """init_process_group over the store served on 127.0.0.1:`port` (serve_store in the launching process), or,
    with port None and one rank, over a store of this process's own; kwargs go to init_process_group."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if port is None:
        if world != 1:
            raise ValueError(f"world={world}: ranks of a local job join their launcher's store (port=...)")
        store = serve_store(timeout_s)
    else:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs)
