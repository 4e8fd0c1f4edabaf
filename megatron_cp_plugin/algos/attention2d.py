"""Attention2D (attention2d.txt): attention parallel over both the query and the key/value dimension.

P ranks form an R x C grid (`cp_grid.CPGrid`); tokens are cyclic (token t on group rank t mod P), so rank p
holds the `s` tokens p, p + P, p + 2P, ... of q, k, v.

Attention2D-NO forward (Alg. 1):
  line 2  K, V move from column-major to row-major ownership (one permutation): position (i, j) then holds
          the K, V tokens = i*C + j (mod P), so grid column j holds the tokens = j (mod C);
  line 3  Q is all-gathered in the grid row (C chunks), line 4 K, V in the grid column (R chunks);
  line 5  the local partial (o, lse) of the row's queries over the column's keys, with a flash kernel;
  line 6  partials go back to their cyclic owners in the row in one all-to-all: each is the normalized
          partial output with its lse, both fp32 (as decode-CP engines merge), not the paper's rescaled
          numerators and denominators, which need a row max first (an extra all-reduce);
  line 7  AttnFix (Alg. 2) at the owner, in fp32: lse = log sum exp(lse_c) (the paper's max m and sum of
          exp(lse_c - m), in torch.logsumexp), o = sum exp(lse_c - lse) o_c.
Attention2D-NO backward (Alg. 3): D = rowsum(dO o O) is formed by the owner and gathered in its place (O is
never gathered), Q, dO, D, lse in rows and K, V in columns; the local block backward from the global (o, lse);
dQ partials summed at their owners in the row, dK, dV in the column (lines 7-8: all-to-alls of partials summed
in fp32 at the owner, where the paper reduce-scatters), then dK, dV move back to column-major (line 9). dK, dV
partials travel in the input dtype, each rounded once. o and dQ partials stay fp32: both carry a component
that the sum cancels or the backward amplifies (docs/design.md, wire precision, rule 3).

Causal masks without an S x S mask: a gathered Q chunk holds tokens a + mP (a = a member's group rank), a
K, V chunk tokens c + nP; key c + nP is visible to query a + mP iff n < m, or n == m and c <= a. So every
(Q chunk, K chunk) pair is one triangle of the flash kernel: with its diagonal ("causal") when c <= a, without it
("causal_strict": one causal call on Q[1:], `local_attn.strict_fwd`) when c > a. This holds for square and
rectangular grids and for the node-aware rank placement alike. Fewer, larger calls (line 5 as the paper runs it,
one FlashAttn with a lower-triangular mask): on the column-major placement the row's Q chunks have residues
i + cR and the column's K, V chunks j + rC, so for T a multiple of lcm(R, C) they fall into groups of n = P / T
chunks with residues a, a + T, ..; interleaved, a group's rows are the tokens a + Tu in order, and a (Q group,
K, V group) pair is again one triangle, by the rule above with T for P (`ChunkGroups`). A square grid is one
call per rank (n = R = C), an R x C grid with R = kC (or C = kR) k calls of n = min(R, C) chunks, each of at
most the grid's group_tokens query rows (cp_grid.GROUP_TOKENS; smaller groups, more calls, beyond it); on the
node-aware placement every pair stays a call of its own. Interleaving costs one copy of the gathered Q, dO and
K, V (none where n = 1); merges and accumulator adds fall from one per chunk pair to one per group pair. Packed
sequences (each document cyclic on its own) keep this per document: every chunk holds 1/P of each document, so
each pair is one varlen call over the documents, cu_seqlens * n / P, with the pair's mask inside each document.

Where every chunk pair is a call of its own (groups of one chunk: rectangular grids, P = 2's 2 x 1, shards too
long to group, the node-aware placement), the gathers are posted and the rank computes while they travel: first
its own pair (its Q against its own K, V: neither gathered), then its Q against the column's other K, V chunks
once they land, then the row's other Q chunks (`pair_order`, `_Gathered`). Same bytes, same calls; only their
order and the online-softmax merges' order differ. On a slow link this hides a block's compute worth of each
gather (2 GPUs over sockets: a gather there takes longer than the whole local block). The paper's Attention2D-NO
waits for them. On an R x 1 grid (P = 2's 2 x 1) the backward's dK, dV exchange (line 8) is hidden too: the own
pair is split by keys (`own_split`), keys [:s1] first (behind the gather), then the column's other chunks' pairs,
then their partials posted to their owners and the own keys [s1:] computed while they travel (`_backward_split`:
one or two kernel calls more, the same bytes; on 2 x H200 over NVLink the rank's local work equals ring's while the
exchange waited, 10 ms of a 241 ms fwd+bwd went to communication). The own Q chunk's O is this rank's: no surrogate.

Attention2D-O (Alg. 4-11) overlaps the same communication with the computation: see `attention2d_o.py`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm import CommStats, all_gather_start, all_to_all, permute, reduce_at_owner, reduce_at_owner_start
from ..cp_grid import CPGrid, group_chunks, kv_moves
from ..kernels.local_attn import acc_dtype, attention_delta, block_bwd_into, block_fwd_into, surrogate_out
from ..kernels.merge import finite_lse
from ..kernels.segments import Segments
from ._function import CPAttention


def pair_mask(q_res: int, kv_res: int, causal: bool) -> str:
    """Mask of the block (queries = q_res mod P in order) x (keys = kv_res mod P in order)."""
    if not causal:
        return "none"
    return "causal" if kv_res <= q_res else "causal_strict"


def kv_to_row_major(grid: CPGrid, x: torch.Tensor, stats=None, phase="forward", inverse=False) -> torch.Tensor:
    """Alg. 1 line 2 (and Alg. 3 line 9 with inverse=True) on x [n, ...]: the rank at position (i, j) gets the
    tensor of group rank i*C + j. An identity on the node-aware placement, skipped there."""
    if not any(kv_moves(p, grid.rows, grid.cols, grid.row_major) for p in range(grid.world)):
        return x
    dst = grid.at(*divmod(grid.rank, grid.cols))        # where this rank's K, V go
    src = grid.kv_owner(grid.i, grid.j)                 # whose K, V this position receives
    if inverse:
        return permute(grid.group, x, src, dst, stats, phase)
    return permute(grid.group, x, dst, src, stats, phase)


def attn_fix_all_to_all(grid: CPGrid, o_part, lse_part, stats=None):
    """Alg. 1 lines 6-7: send the row's C partials of every query to their owner and merge them there.

    o_part [C, b, s, h, d] and lse_part [C, b, h, s] in the accumulator dtype (chunk c = queries of row member
    c) -> this rank's (o, lse). The partials travel as they are (fp32: docs/design.md, wire precision).
    """
    if grid.cols == 1:
        return o_part[0], lse_part[0]
    o_all, lse_all = all_to_all(grid.row, [o_part, lse_part], stats)
    # AttnFix (Alg. 2), at the owner: lse = log sum exp(lse_c) (-inf where no partial saw a key), then o = sum of
    # o_c weighted by exp(lse_c - lse), weights normalised on the lse rows (no pass over o divides) and summed
    # into o one partial at a time (no [C, ...] temporary).
    lse = torch.logsumexp(lse_all, 0)
    w = torch.exp(lse_all - finite_lse(lse)).transpose(2, 3).unsqueeze(-1)     # [C, b, s, h, 1]; 0: no key
    o = o_all[0] * w[0]
    for c in range(1, grid.cols):
        o.addcmul_(o_all[c], w[c])
    return o, lse


@dataclass(frozen=True)
class ChunkGroups:
    """Line 5's kernel calls: the row's Q chunks and the column's K, V chunks in groups of n = P / T chunks with
    residues a, a + T, ..., a + (n - 1) T (a < T). Interleaved (row m n + x = chunk x's row m) a group's tokens
    are a + T u in order, u = 0 .. n s - 1, so a Q group (a) x K, V group (c) pair is one triangle, as one chunk
    pair is (`pair_mask(a, c)`: key c + T t visible to query a + T u iff t < u, or t == u and c <= a), n^2 times
    its size, n from `cp_grid.group_chunks`. Q group g holds row chunks g, g + kq, ... (kq = len(q_res)), K, V group g
    column chunks g, g + kk, ... (kk = len(kv_res))."""

    n: int
    q_res: tuple
    kv_res: tuple

    def segments(self, packing):
        """A group's documents (packed): every chunk holds 1/P of each, so the group n/P of each, in order."""
        return None if packing is None else Segments(tuple(o * self.n for o in packing.local.offsets))


def chunk_groups(grid: CPGrid, tokens: int) -> ChunkGroups:
    """The groups of `group_chunks`' size, or of one chunk each where the placement does not split into them (the
    node-aware one, whose row holds consecutive residues: every chunk pair a call of its own)."""
    P = grid.world
    q_res = [grid.row_ranks[c] for c in range(grid.cols)]
    kv_res = [grid.kv_owner(r, grid.j) for r in range(grid.rows)]

    def split(res, n):
        T, k = P // n, len(res) // n
        if any(res[g] >= T or res[g + x * k] != res[g] + x * T for g in range(k) for x in range(n)):
            return None
        return tuple(res[:k])

    n = group_chunks(grid.rows, grid.cols, tokens, grid.group_tokens)
    qg, kg = split(q_res, n), split(kv_res, n)
    if qg is None or kg is None:
        n, qg, kg = 1, tuple(q_res), tuple(kv_res)
    return ChunkGroups(n, qg, kg)


def regroup(x: torch.Tensor, k: int, seq: int) -> list:
    """The gathered chunks x [R or C, ...] (dim `seq` of a chunk its rows) as k groups (ChunkGroups: group g holds
    chunks g, g + k, ...), each one sequence in token order, chunk x's row m at row m n + x: views for groups of one
    chunk, else one copy each (x is then no longer needed: the caller keeps only the groups)."""
    out = []
    for g in range(k):
        chunks = x[g::k]
        if chunks.shape[0] == 1:
            out.append(chunks[0])
            continue
        y = chunks.movedim(0, seq + 1)
        out.append(y.reshape(y.shape[:seq] + (-1,) + y.shape[seq + 2:]))
    return out


class Grouped:
    """The partials of every chunk, [k groups of n chunks, *per] with rows along dim `seq` of `per`, stored so that
    a group's interleaved rows are one view (`group`) and every chunk's, in chunk order, another (`chunks`; strided
    where n > 1). Groups of one chunk (n = 1): chunk-major, every chunk contiguous."""

    def __init__(self, per: tuple, seq: int, n: int, k: int, dtype, device):
        self.per, self.seq, self.n, self.k = tuple(per), seq, n, k
        shape = (k,) + self.per if n == 1 else self.per[:seq + 1] + (n, k) + self.per[seq + 1:]
        self.buf = torch.empty(shape, dtype=dtype, device=device)

    def group(self, g: int) -> torch.Tensor:
        if self.n == 1:
            return self.buf[g]
        per, seq = self.per, self.seq
        return self.buf.select(seq + 2, g).view(per[:seq] + (per[seq] * self.n,) + per[seq + 1:])

    def chunks(self) -> torch.Tensor:
        """[n k, *per], chunk x k + g (group g's x-th) at its index in the row or column."""
        if self.n == 1:
            return self.buf
        return self.buf.movedim((self.seq + 1, self.seq + 2), (0, 1)).view((self.n * self.k,) + self.per)


class _Gathered:
    """Lines 3-4's gather of x in `group` (the row's or the column's), posted: its groups (`regroup`) are read once
    first needed, after the gather has landed; group `own` (the rank's own chunk, groups of one chunk) is x itself,
    read before it has."""

    def __init__(self, group, x, k: int, seq: int, own: int | None, stats, phase):
        self.started, self.k, self.seq = all_gather_start(group, x, stats, phase), k, seq
        self.own, self.x, self.groups = own, x, None

    def __getitem__(self, g: int) -> torch.Tensor:
        if g == self.own:
            return self.x
        if self.groups is None:
            out, posted = self.started
            posted.wait()
            self.groups, self.started = regroup(out, self.k, self.seq), None
        return self.groups[g]


def pair_order(grid: CPGrid, grp: ChunkGroups) -> tuple[list, int | None, int | None]:
    """(pairs, own Q group, own K, V group): every (Q group, K, V group) pair, a Q group's pairs together. Groups of
    one chunk: the rank's own pair first (needs no gather), then its Q's other pairs (the column's gather), then
    the rest (the row's), so that it computes while the gathers travel; else in order, nothing own."""
    pairs = [(a, c) for a in range(len(grp.q_res)) for c in range(len(grp.kv_res))]
    if grp.n > 1:
        return pairs, None, None
    a0, c0 = grid.j, grid.i                          # this rank's Q chunk in its row, its K, V chunk in its column
    return sorted(pairs, key=lambda ac: (ac != (a0, c0), ac[0] != a0)), a0, c0


def own_split(grid: CPGrid, grp: ChunkGroups, s: int, packing) -> int | None:
    """Where the backward splits the own pair by keys (`_backward_split`): s1, so that keys [:s1] come before the
    other K, V chunks' pairs (behind the column's gather) and keys [s1:] after their dK, dV partials are posted
    (behind that exchange); None where the plain order runs: grouped chunks, a row of several Q chunks (C > 1: its
    dQ exchange comes last too), no column (R = 1), packed documents (a split would cut them). The last part holds
    about half the own triangle, (s - s1)^2 = s^2 / 2, its row count a multiple of 64 from 128 rows on."""
    if grp.n > 1 or grid.cols > 1 or grid.rows == 1 or packing is not None or s < 2:
        return None
    keep = int(s * 0.7071)
    keep -= keep % 64 if keep >= 128 else 0
    return s - keep if 0 < keep < s else None


def _forward(grid: CPGrid, q, k, v, *, causal, scale, backend, stats=None, packing=None):
    """q [b, s, h, d], k, v [b, s, h_kv, d] (cyclic shards) -> (o in q.dtype, saved (q, row-major kv, o, lse))."""
    acc, grp = acc_dtype(q.dtype), chunk_groups(grid, q.shape[0] * q.shape[1])
    kq, kk = len(grp.q_res), len(grp.kv_res)
    seg = grp.segments(packing)
    # Line 2: K, V to row-major ownership (packed: one all-to-all).
    kv = kv_to_row_major(grid, torch.stack([k, v]), stats)
    # Lines 3-4: K, V gathered in the column, Q in the row, posted (the column's first: the own Q's pairs need it
    # first); the gathered chunks read as their groups (ChunkGroups), interleaved (copies only where n > 1).
    pairs, a0, c0 = pair_order(grid, grp)
    kv_g = _Gathered(grid.col, kv, kk, 2, c0, stats, "forward")           # kk x [2, b, n s, h_kv, d]
    q_g = _Gathered(grid.row, q, kq, 1, a0, stats, "forward")             # kq x [b, n s, h, d]
    # Line 5: the local partial, one flash-kernel triangle per (Q group, K, V group), the own pair first.
    b, s, h, d = q.shape
    o_part = Grouped((b, s, h, d), 1, grp.n, kq, acc, q.device)
    lse_part = Grouped((b, h, s), 2, grp.n, kq, acc, q.device)
    for i, (a, c) in enumerate(pairs):
        block_fwd_into(o_part.group(a), lse_part.group(a), q_g[a], kv_g[c][0], kv_g[c][1],
                       first=i == 0 or pairs[i - 1][0] != a, mask=pair_mask(grp.q_res[a], grp.kv_res[c], causal),
                       scale=scale, backend=backend, cu_seqlens_q=seg)
    # Lines 6-7: the partials to their owners in the row, merged there (AttnFix).
    o, lse = attn_fix_all_to_all(grid, o_part.chunks(), lse_part.chunks(), stats)
    o = o.to(q.dtype)
    return o, (q, kv, o, lse)


def _backward(grid: CPGrid, do, q, kv, o, lse, *, causal, scale, backend, stats=None, packing=None):
    """Alg. 3 from the saved row-major K, V `kv` [2, b, s, h_kv, d]: (dq, dk, dv) in the input dtype."""
    acc, grp = acc_dtype(q.dtype), chunk_groups(grid, q.shape[0] * q.shape[1])
    kq, kk = len(grp.q_res), len(grp.kv_res)
    seg = grp.segments(packing)
    ph = "backward"
    # Lines 4-5: Q, dO, D, lse in the row; K, V in the column; each as its groups (as in the forward).
    delta = attention_delta(do, o)
    pairs, a0, c0 = pair_order(grid, grp)
    kv_g = _Gathered(grid.col, kv, kk, 2, c0, stats, ph)                  # posted, read as in the forward
    q_g = _Gathered(grid.row, q, kq, 1, a0, stats, ph)
    do_g = _Gathered(grid.row, do, kq, 1, a0, stats, ph)
    stat_g = _Gathered(grid.row, torch.stack([delta, lse.to(acc)]), kq, 3, a0, stats, ph)   # [2, b, h, n s]
    # Line 6: the backward of each (Q group, K, V group) triangle from the global (o, lse), the own pair first.
    # Every partial starts as its first call's result (no zero-fill).
    b, s, h, d = q.shape
    dq_part = Grouped((b, s, h, d), 1, grp.n, kq, acc, q.device)
    dkv_part = Grouped((2, b, s) + tuple(kv.shape[3:]), 2, grp.n, kk, acc, q.device)
    split = own_split(grid, grp, s, packing)
    if split is not None:
        dkv = _backward_split(grid, grp, split, dq_part, dkv_part, (q, do, o, stat_g[a0][1]), kv_g, causal=causal,
                              scale=scale, backend=backend, stats=stats)
        dq = reduce_at_owner(grid.row, dq_part.chunks(), grid.j, acc, stats, ph)
        dkv = kv_to_row_major(grid, dkv.to(q.dtype), stats, ph, inverse=True)
        return dq.to(q.dtype), dkv[0], dkv[1]
    seen_kv = set()
    for i, (a, c) in enumerate(pairs):
        if i == 0 or pairs[i - 1][0] != a:           # O is not gathered (the own chunk's is here): built once for
            o_g = o if a == a0 else surrogate_out(do_g[a], stat_g[a][0])         # the group's K, V groups
        dkv_g = dkv_part.group(c)
        block_bwd_into(dq_part.group(a), dkv_g[0], dkv_g[1], do_g[a], q_g[a], kv_g[c][0], kv_g[c][1], o_g,
                       stat_g[a][1], first_q=i == 0 or pairs[i - 1][0] != a, first_kv=c not in seen_kv,
                       mask=pair_mask(grp.q_res[a], grp.kv_res[c], causal), scale=scale, backend=backend,
                       cu_seqlens_q=seg)
        seen_kv.add(c)
    # Lines 7-9: dQ summed at its owner in the row, dK, dV in the column, then back to column-major.
    dq = reduce_at_owner(grid.row, dq_part.chunks(), grid.j, acc, stats, ph)      # fp32: see the module docstring
    dkv = reduce_at_owner(grid.col, dkv_part.chunks(), grid.i, q.dtype, stats, ph).to(q.dtype)
    dkv = kv_to_row_major(grid, dkv, stats, ph, inverse=True)
    return dq.to(q.dtype), dkv[0], dkv[1]


def _backward_split(grid: CPGrid, grp: ChunkGroups, s1: int, dq_part, dkv_part, own, kv_g, *, causal, scale, backend,
                    stats):
    """Line 6 on an R x 1 grid (`own_split`), with line 8's dK, dV exchange behind the compute: the own pair's keys
    [:s1] (behind the column's gather), the column's other K, V chunks' pairs, their partials posted to their owners
    (`reduce_at_owner_start`), then the own pair's keys [s1:] while they travel. Returns the own chunk's dK, dV sum
    [2, b, s, h_kv, d] (fp32). The plain order's calls and two more (the own pair in three; one more, in two,
    not causal), the same bytes."""
    q, do, o, lse = own                             # the row's one Q chunk is this rank's: its O is here, no surrogate
    a0, c0 = 0, grid.i
    mask = pair_mask(grp.q_res[a0], grp.kv_res[c0], causal)
    dq, dkv0 = dq_part.group(a0), dkv_part.group(c0)
    k0, v0 = kv_g[c0][0], kv_g[c0][1]
    lo, hi = slice(0, s1), slice(s1, None)
    kw = dict(scale=scale, backend=backend)

    def rows(x, r):                                  # [b, s, ...] rows r; lse [b, h, s] columns r
        return x[..., r] if x is lse else x[:, r]

    def call(qr, kr, m, first_q, first_kv):
        block_bwd_into(dq[:, qr], dkv0[0][:, kr], dkv0[1][:, kr], rows(do, qr), rows(q, qr), k0[:, kr], v0[:, kr],
                       rows(o, qr), rows(lse, qr), first_q=first_q, first_kv=first_kv, mask=m, **kw)

    # The own pair's keys [:s1]: queries [:s1] under the pair's mask, [s1:] see all of them (causal); every query
    # row at once (not causal).
    if causal:
        call(lo, lo, mask, True, True)
        call(hi, lo, "none", True, False)
    else:
        call(slice(None), lo, "none", True, True)
    # The column's other K, V chunks, then their partials home (the own chunk's slot travels unfinished, unread).
    for c in range(len(grp.kv_res)):
        if c != c0:
            dkv_c = dkv_part.group(c)
            block_bwd_into(dq, dkv_c[0], dkv_c[1], do, q, kv_g[c][0], kv_g[c][1], o, lse, first_q=False,
                           first_kv=True, mask=pair_mask(grp.q_res[a0], grp.kv_res[c], causal), **kw)
    posted = reduce_at_owner_start(grid.col, dkv_part.chunks(), grid.i, q.dtype, stats, "backward")
    # The own pair's keys [s1:] while they travel: only queries [s1:] see them (causal).
    call(hi if causal else slice(None), hi, mask, False, True)
    return posted.wait(dkv_part.chunks()[c0])


def attention2d_no(q, k, v, *, group: CPGrid, causal: bool = True, softmax_scale: float, backend: str | None = None,
                   comm_stats: CommStats | None = None, packing=None):
    """Attention2D-NO on validated cyclic shards: q [b, s, h, d], k, v [b, s, h_kv, d] -> [b, s, h, d]
    (`packing`: the `_packing.Packing` of a packed sequence, each document cyclic on its own)."""
    return CPAttention.apply(q, k, v, _forward, _backward, group, causal, softmax_scale, backend, comm_stats,
                             packing)
