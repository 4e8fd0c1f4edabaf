"""Attention2D (attention2d.txt): attention parallel over both the query and the key/value dimension.

P ranks form an R x C grid (`comm.CPGrid`); tokens are cyclic (token t on group rank t mod P), so rank p
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
(Q chunk, K chunk) pair is one triangle of the flash kernel: with its diagonal ("causal") when c <= a,
without it ("causal_strict": causal on Q[1:], K[:-1]) when c > a. This holds for square and rectangular
grids and for the node-aware rank placement alike; each rank computes its R x C pairs. Packed sequences
(each document cyclic on its own) keep this per document: every chunk holds 1/P of each document, so each pair
is one varlen call over the documents, cu_seqlens / P, with the pair's mask inside each document.

Attention2D-O (Alg. 4-11) overlaps the same communication with the computation: see `attention2d_o.py`.
"""
from __future__ import annotations

import torch

from ..comm import CommStats, CPGrid, all_gather, all_to_all, kv_moves, permute, reduce_at_owner
from ..kernels.local_attn import acc_dtype, attention_delta, block_bwd_into, block_fwd_into, surrogate_out
from ..kernels.merge import finite_lse
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


def _forward(grid: CPGrid, q, k, v, *, causal, scale, backend, stats=None, packing=None):
    """q [b, s, h, d], k, v [b, s, h_kv, d] (cyclic shards) -> (o in q.dtype, saved (q, row-major kv, o, lse))."""
    R, C, acc = grid.rows, grid.cols, acc_dtype(q.dtype)
    seg = packing.local if packing is not None else None          # every chunk holds 1/P of each document
    # Line 2: K, V to row-major ownership (packed: one all-to-all).
    kv = kv_to_row_major(grid, torch.stack([k, v]), stats)
    # Lines 3-4: Q gathered in the row, K, V in the column.
    q_all = all_gather(grid.row, q, stats)                          # [C, b, s, h, d]
    kv_all = all_gather(grid.col, kv, stats)                        # [R, 2, b, s, h_kv, d]
    # Line 5: the local partial, one flash-kernel triangle per (Q chunk, K, V chunk).
    o_part = torch.empty(q_all.shape, dtype=acc, device=q.device)
    lse_part = torch.empty((C,) + (q.shape[0], q.shape[2], q.shape[1]), dtype=acc, device=q.device)
    for c in range(C):
        for r in range(R):
            mask = pair_mask(grid.row_ranks[c], grid.kv_owner(r, grid.j), causal)
            block_fwd_into(o_part[c], lse_part[c], q_all[c], kv_all[r, 0], kv_all[r, 1], first=r == 0, mask=mask,
                           scale=scale, backend=backend, cu_seqlens_q=seg)
    # Lines 6-7: the partials to their owners in the row, merged there (AttnFix).
    o, lse = attn_fix_all_to_all(grid, o_part, lse_part, stats)
    o = o.to(q.dtype)
    return o, (q, kv, o, lse)


def _backward(grid: CPGrid, do, q, kv, o, lse, *, causal, scale, backend, stats=None, packing=None):
    """Alg. 3 from the saved row-major K, V `kv` [2, b, s, h_kv, d]: (dq, dk, dv) in the input dtype."""
    R, C, acc = grid.rows, grid.cols, acc_dtype(q.dtype)
    seg = packing.local if packing is not None else None
    ph = "backward"
    # Lines 4-5: Q, dO, D, lse in the row; K, V in the column.
    delta = attention_delta(do, o)
    q_all, do_all = all_gather(grid.row, q, stats, ph), all_gather(grid.row, do, stats, ph)
    stat_all = all_gather(grid.row, torch.stack([delta, lse.to(acc)]), stats, ph)  # [C, 2, b, h, s]
    kv_all = all_gather(grid.col, kv, stats, ph)
    # Line 6: block backward per pair from the global (o, lse).
    # Every partial starts as its first block's result (no zero-fill): dQ chunk c at r = 0, dK, dV chunk r at c = 0.
    dq_part = torch.empty(q_all.shape, dtype=acc, device=q.device)
    dkv_part = torch.empty(kv_all.shape, dtype=acc, device=q.device)
    for c in range(C):
        o_c = surrogate_out(do_all[c], stat_all[c, 0])     # O is not gathered: built once for the R key chunks
        for r in range(R):
            mask = pair_mask(grid.row_ranks[c], grid.kv_owner(r, grid.j), causal)
            block_bwd_into(dq_part[c], dkv_part[r, 0], dkv_part[r, 1], do_all[c], q_all[c], kv_all[r, 0],
                           kv_all[r, 1], o_c, stat_all[c, 1], first_q=r == 0, first_kv=c == 0, mask=mask,
                           scale=scale, backend=backend, cu_seqlens_q=seg)
    # Lines 7-9: dQ summed at its owner in the row, dK, dV in the column, then back to column-major.
    dq = reduce_at_owner(grid.row, dq_part, grid.j, acc, stats, ph)      # fp32: see the module docstring
    dkv = reduce_at_owner(grid.col, dkv_part, grid.i, q.dtype, stats, ph).to(q.dtype)
    dkv = kv_to_row_major(grid, dkv, stats, ph, inverse=True)
    return dq.to(q.dtype), dkv[0], dkv[1]


def attention2d_no(q, k, v, *, group: CPGrid, causal: bool = True, softmax_scale: float, backend: str | None = None,
                   comm_stats: CommStats | None = None, packing=None):
    """Attention2D-NO on validated cyclic shards: q [b, s, h, d], k, v [b, s, h_kv, d] -> [b, s, h, d]
    (`packing`: the `_packing.Packing` of a packed sequence, each document cyclic on its own)."""
    return CPAttention.apply(q, k, v, _forward, _backward, group, causal, softmax_scale, backend, comm_stats,
                             packing)
