"""Attention2D-O (attention2d.txt, Alg. 4-11): Attention2D with its communication overlapped.

Same grid, layout, masks and result as Attention2D-NO (`attention2d.py`); the gathers and reduce-scatters
become rings whose next transfer is posted before the current block's compute (`comm.Ring`, double buffered:
one block in hand, one in flight).

Forward (Alg. 4): K, V to row-major (line 2); the own Q block starts round the grid row (line 4) while
GthrCmpt (Alg. 5) passes K, V blocks round the grid column, computing the own Q block against each as it
arrives and keeping them (line 5); GthrCmptSctr (Alg. 6) then takes each arriving Q block against all the
column's K, V and passes its partial (o, lse) round the row, merged with AttnFix at every hop, so that it
ends on its owner (a ring reduce-scatter, Alg. 7); finally the own partial merges with what came home (line 8).
Backward (Alg. 8): Q, dO, D, lse go round the row; GthrCmptBwd (Alg. 9) gathers K, V in the column while
doing the own Q block; GthrCmptSctrBwd (Alg. 10) does the others, passing the dQ accumulators round the row;
in its last pass CmptSctrBwd (Alg. 11) takes the K, V chunks in ring order and sends each chunk's finished
dK, dV accumulator down the column while computing the next (the column reduce-scatter); line 9 moves dK,
dV back to column-major. With one grid column (C = 1) the own pass is the last pass and does both.

Batched passes: every pass after the first has the column's K, V chunks in hand (pass 0 kept them), so its Q block
meets them in one kernel call per mask (the chunks of residue <= the block's with the diagonal, the rest strictly
causal) over the batch dimension, at most `batch_cap` chunks a call (the grid's group_tokens query rows, as
Attention2D-NO's grouped calls: chunks of more than 8k tokens keep one call each, as the paper writes it), the
call's partials merged in one launch (`merge_many_`); so do the backward's middle passes (the last keeps one call a
chunk, each chunk's dK, dV sent down the column as soon as it is final, Alg. 11). At P = 64 on 8 x 8 that was at
most 22 forward calls instead of 64 and 28 backward instead of 64; shards that short now take the schedule below.

Short shards (8k tokens a rank or fewer, `cp_grid.overlap_pays`) run Attention2D-NO's schedule instead: a pair's
compute there is shorter than a ring hop's host time, so the rings hide nothing and their launches bind the rank.

Wire precision (docs/design.md): a dK, dV accumulator that is summed into on its way round a column ring of
more than one hop travels in fp32; round a ring of one hop (R = 2) it is summed once, at its owner, and
travels in the input dtype. o and dQ accumulators, lse and D always travel in fp32.
Bytes per rank (n_q = b s h d, n_kv = b s h_kv d, n_r = b h s; e = element size; w_R = e if R = 2 else 4):
  forward  perm + (C-1) (n_q e + (n_q + n_r) 4) + (R-1) 2 n_kv e
  backward perm + (C-1) (2 n_q e + 2 n_r 4 + n_q 4) + (R-1) 2 n_kv (e + w_R)
where perm = 2 n_kv e when the placement moves K, V (see `cp_grid.attention2d_bytes`).

Indices (this rank is processor p_{i,j} of the R x C grid): pass t = 0 .. C-1 computes with the Q block that has
made t hops round the row ring, that of grid column (j - t) mod C; inside a pass, hop u = 0 .. R-1 takes the
K, V chunk that has made u hops round the column ring, that of grid row (i - u) mod R (during pass 0 it is
just arriving; later passes read the chunks pass 0 kept). Packed sequences: every (Q block, K, V chunk) pair
is one varlen call over the documents, cu_seqlens / P (`Packing.local`), with the pair's mask in each.
"""
from __future__ import annotations

import torch

from .. import cp_grid
from ..comm import CommStats, Ring, wire_dtype
from ..cp_grid import CPGrid
from ..kernels.local_attn import (acc_dtype, attention_delta, block_bwd, block_bwd_into, block_fwd, block_fwd_into,
                                  strict_bwd, strict_fwd, surrogate_out)
from ..kernels.merge import accumulate_, merge_, merge_many_
from ._function import CPAttention
from . import attention2d as a2d_no
from .attention2d import kv_to_row_major, pair_mask


def _rings(grid: CPGrid, phase: str, stats):
    row = Ring(grid.row, phase, stats) if grid.cols > 1 else None
    col = Ring(grid.col, phase, stats) if grid.rows > 1 else None
    return row, col


# ----------------------------------------------------------------------------------------------- batched passes
# Every pass after the first has all R K, V chunks of the column in hand (pass 0 kept them), so its Q block meets
# them in a few batched kernel calls instead of R: the chunks stacked in residue order (`Stacked`), those a block's
# queries see with the diagonal ("causal": residue <= the Q block's) and the rest ("causal_strict") each one call
# over the batch dimension (the Q block repeated), at most `cap` chunks a call so that a call's rows stay within
# the grid's group_tokens (as Attention2D-NO's grouped calls): large chunks keep one call a chunk, unchanged. The
# partials of a call merge into the pass's in one launch (`merge_many_`), its dQ in one sum.
class Stacked:
    """The column's K, V chunks [R, b, s, h_kv, d] each, in residue order; `pos[r]`: grid row r's place."""

    def __init__(self, grid: CPGrid, chunks):
        order = sorted(range(grid.rows), key=lambda r: grid.kv_owner(r, grid.j))
        self.res = [grid.kv_owner(r, grid.j) for r in order]
        self.pos = {r: x for x, r in enumerate(order)}
        self.k = torch.stack([chunks[r][0] for r in order])
        self.v = torch.stack([chunks[r][1] for r in order])

    def batches(self, q_res: int, causal: bool, cap: int):
        """(mask, lo, hi): the calls of a Q block of residue q_res, chunks lo..hi-1 of the stack each."""
        cut = sum(c <= q_res for c in self.res) if causal else len(self.res)
        out = []
        for a, z, mask in ((0, cut, "causal" if causal else "none"), (cut, len(self.res), "causal_strict")):
            out += [(mask, lo, min(z, lo + cap)) for lo in range(a, z, cap)]
        return out


def batch_cap(q, grid: CPGrid) -> int:
    """Chunks one batched call may take: within the grid's cap on query rows (cp_grid.batch_chunks; b s a chunk)."""
    return cp_grid.batch_chunks(grid.rows, q.shape[0] * q.shape[1], grid.group_tokens)


def _rows(mask):
    """The query rows a batched call of `mask` covers (strict: rows 1:, `strict_fwd`)."""
    return slice(1, None) if mask == "causal_strict" else slice(None)


def _repeat(x, m):
    """x [b, ...] as [m b, ...]: the Q block (and dO, O, lse) once for each chunk of a batched call."""
    return x.unsqueeze(0).expand((m,) + tuple(x.shape)).flatten(0, 1)


def fwd_batched(o_t, lse_t, q_blk, st: Stacked, q_res, causal, cap, *, scale, backend):
    """Alg. 6 line 5 and 6 for a pass after the first: (o_t, lse_t) [b, s, h, d] / [b, h, s] set from its calls."""
    b, first = q_blk.shape[0], True
    for mask, lo, hi in st.batches(q_res, causal, cap):
        m, qs = hi - lo, _rows(mask)
        if mask == "causal_strict" and first:       # row 0 sees no key of a strict chunk
            o_t[:, :1].zero_()
            lse_t[:, :, :1].fill_(float("-inf"))
        if q_blk.shape[1] > 1 or mask != "causal_strict":
            args = (_repeat(q_blk, m), st.k[lo:hi].flatten(0, 1), st.v[lo:hi].flatten(0, 1))
            if mask == "causal_strict":
                o_b, lse_b = strict_fwd(*args, scale=scale, backend=backend)
            else:
                o_b, lse_b = block_fwd(*args, mask=mask, scale=scale, backend=backend)
            merge_many_(o_t[:, qs], lse_t[:, :, qs], o_b.unflatten(0, (m, b)), lse_b.unflatten(0, (m, b)), first=first)
        first = False


def bwd_batched(dq_t, dkv_part, blk, o_j, st: Stacked, q_res, causal, cap, *, scale, backend):
    """Alg. 10 line 5 for a pass after the first and before the last: dq_t set, dkv_part [R (stack order), 2, b, s,
    h_kv, d] added into (every chunk already has pass 0's part)."""
    q_j, do_j, _, lse_j = blk
    b, acc, first = q_j.shape[0], dq_t.dtype, True
    for mask, lo, hi in st.batches(q_res, causal, cap):
        m, qs = hi - lo, _rows(mask)
        if mask == "causal_strict" and first:
            dq_t[:, :1].zero_()
        if q_j.shape[1] > 1 or mask != "causal_strict":
            args = (_repeat(do_j, m), _repeat(q_j, m), st.k[lo:hi].flatten(0, 1), st.v[lo:hi].flatten(0, 1),
                    _repeat(o_j, m), _repeat(lse_j, m))
            if mask == "causal_strict":
                dq, dk, dv, ks = strict_bwd(*args, scale=scale, backend=backend)
            else:
                (dq, dk, dv), ks = block_bwd(*args, mask=mask, scale=scale, backend=backend), slice(None)
            dq = dq.unflatten(0, (m, b)).sum(0, dtype=acc)
            (dq_t[:, qs].copy_ if first else dq_t[:, qs].add_)(dq)
            for x, g in enumerate((dk, dv)):
                add_chunks_(dkv_part[lo:hi, x], g.unflatten(0, (m, b)), ks)
        first = False


def add_chunks_(dst, g, ks):
    """dst[:, :, ks] += g: dst [m, b, s, h_kv, d] fp32 (m chunks' dK or dV, a strided slab of dkv_part), g [m, b, s',
    h_kv, d] one batched call's gradients. One accumulate_ launch (4-dim views) where b = 1 or every key row is
    covered (b and s merge); else one a chunk. One launch a chunk was 126 of them a backward at P = 64 (8 x 8),
    4.6 ms of an H100 rank's profile (docs/performance.md, ninth session)."""
    m, b = g.shape[:2]
    part = dst[:, :, ks]
    if b == 1:
        accumulate_(part[:, 0], g[:, 0])
    elif ks == slice(None):
        accumulate_(part.view(m, b * part.shape[2], *part.shape[3:]), g.reshape(m, b * g.shape[2], *g.shape[3:]))
    else:
        for u in range(m):
            accumulate_(part[u], g[u])


def _forward(grid: CPGrid, q, k, v, *, causal, scale, backend, stats=None, packing=None):
    """q [b, s, h, d], k, v [b, s, h_kv, d] (cyclic shards) -> (o in q.dtype, saved (q, row-major kv, o, lse))."""
    R, C, i, j, acc = grid.rows, grid.cols, grid.i, grid.j, acc_dtype(q.dtype)
    seg = packing.local if packing is not None else None
    kv = kv_to_row_major(grid, torch.stack([k, v]), stats)                   # Alg. 4 line 2
    q_ring, kv_ring = _rings(grid, "forward", stats)
    o_ring, _ = _rings(grid, "forward", stats)
    kv_chunks = [None] * R                           # K, V chunk of every grid row, filled by pass 0 (Alg. 5)
    kv_chunks[i] = kv
    q_blk, own, incoming, st = q, None, None, None
    lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    cap = batch_cap(q, grid) if seg is None and R > 1 else 1
    for t in range(C):                               # t = 0: GthrCmpt (Alg. 5); t >= 1: GthrCmptSctr (Alg. 6)
        if t + 1 < C:                                # Alg. 4 line 4 / Alg. 6 line 4: pass the Q block on
            q_next = q_ring.send_recv((q_blk,))
        q_res = grid.row_ranks[(j - t) % C]          # Q block in hand: column (j - t)'s, tokens = q_res mod P
        o_t = lse_t = None
        if t > 0 and cap > 1:                        # every chunk in hand: batched calls (module comment above)
            if st is None:
                st, kv_chunks = Stacked(grid, kv_chunks), None          # the stack replaces the received chunks
            o_t = torch.empty(q_blk.shape, dtype=acc, device=q.device)
            lse_t = torch.empty(lse_shape, dtype=acc, device=q.device)
            fwd_batched(o_t, lse_t, q_blk, st, q_res, causal, cap, scale=scale, backend=backend)
        for u in (range(R) if o_t is None else ()):
            kv_row = (i - u) % R                     # K, V chunk in hand: grid row (i - u)'s
            if t == 0 and u + 1 < R:                 # Alg. 5 line 4: pass it up the column while computing
                kv_next = kv_ring.send_recv((kv_chunks[kv_row],))
            mask = pair_mask(q_res, grid.kv_owner(kv_row, j), causal)
            if o_t is None:                          # this pass's partial, set by its first block's result
                o_t = torch.empty(q_blk.shape, dtype=acc, device=q.device)
                lse_t = torch.empty(lse_shape, dtype=acc, device=q.device)
            # Alg. 5 / 6 line 5, and line 6 (AttnFix) into the pass's partial
            block_fwd_into(o_t, lse_t, q_blk, kv_chunks[kv_row][0], kv_chunks[kv_row][1], first=u == 0, mask=mask,
                           scale=scale, backend=backend, cu_seqlens_q=seg)
            if t == 0 and u + 1 < R:                 # the next hop's chunk (grid row i - u - 1) has arrived
                kv_ring.wait()
                kv_chunks[(kv_row - 1) % R] = kv_next[0]
        if t == 0:
            own = (o_t, lse_t)                       # our own queries' partial: merged last (Alg. 4 line 8)
        else:                                        # Alg. 6 lines 7-8: AttnFix with what came round the row
            if incoming is not None:
                o_ring.wait()
                merge_(o_t, lse_t, *incoming)
            incoming = o_ring.send_recv((o_t, lse_t))
        if t + 1 < C:
            q_ring.wait()
            q_blk = q_next[0]
    o, lse = own
    if C > 1:                                        # Alg. 4 line 8: the row's partials of our queries
        o_ring.wait()
        merge_(o, lse, *incoming)
    o = o.to(q.dtype)
    return o, (q, kv, o, lse)


def _backward(grid: CPGrid, do, q, kv, o, lse, *, causal, scale, backend, stats=None, packing=None):
    """Alg. 8 from the saved row-major K, V `kv` [2, b, s, h_kv, d]: (dq, dk, dv) in the input dtype."""
    R, C, i, j, acc = grid.rows, grid.cols, grid.i, grid.j, acc_dtype(q.dtype)
    seg = packing.local if packing is not None else None
    q_ring, kv_ring = _rings(grid, "backward", stats)
    dq_ring, dkv_ring = _rings(grid, "backward", stats)
    blk = (q, do, attention_delta(do, o), lse)                                 # Alg. 8 lines 2-4: D, then the ring
    kv_chunks = [None] * R
    kv_chunks[i] = kv
    # dK, dV of every chunk here, each started by pass 0's result for it (no zero-fill), in residue order (Stacked)
    dkv_part = torch.empty((R,) + tuple(kv.shape), dtype=acc, device=q.device)
    order = sorted(range(R), key=lambda r: grid.kv_owner(r, j))
    pos = {r: x for x, r in enumerate(order)}
    cap = batch_cap(q, grid) if seg is None and R > 1 else 1
    dq_in = dkv_in = st = None
    for t in range(C):                               # t = 0: GthrCmptBwd (Alg. 9); t >= 1: GthrCmptSctrBwd (10)
        if t + 1 < C:                                # pass (Q, dO, D, lse) on round the row
            nxt = q_ring.send_recv(blk)
        q_j, do_j, delta_j, lse_j = blk
        o_j = surrogate_out(do_j, delta_j)           # O never travels: built once for the R key chunks
        q_res = grid.row_ranks[(j - t) % C]          # Q block in hand: column (j - t)'s, tokens = q_res mod P
        last = t == C - 1                            # the last pass also reduce-scatters dK, dV (Alg. 11)
        dq_t = None                                  # this Q block's dQ, started by its first block's result
        # Hops in order: pass 0 takes the chunks as they arrive (u = 0, 1, ...); the other passes take rows
        # i-1, i-2, ... and their own row last, so that every chunk's dK, dV is final just when its turn in
        # the column reduce-scatter comes (Alg. 11).
        hops = list(range(R)) if t == 0 else list(range(1, R)) + [0]
        if 0 < t < C - 1 and cap > 1:                # a middle pass, every chunk in hand: batched calls
            if st is None:
                st = Stacked(grid, kv_chunks)        # the stack replaces the received chunks (the last pass reads it)
                kv_chunks = [(st.k[pos[r]], st.v[pos[r]]) for r in range(R)]
            dq_t = torch.empty(q.shape, dtype=acc, device=q.device)
            bwd_batched(dq_t, dkv_part, blk, o_j, st, q_res, causal, cap, scale=scale, backend=backend)
            hops = []
        for u in hops:
            kv_row = (i - u) % R                     # K, V chunk of grid row (i - u)
            if t == 0 and u + 1 < R:                 # Alg. 9 line 4: pass it up the column while computing
                kv_next = kv_ring.send_recv((kv_chunks[kv_row],))
            mask = pair_mask(q_res, grid.kv_owner(kv_row, j), causal)
            first_q = dq_t is None
            if first_q:
                dq_t = torch.empty(q.shape, dtype=acc, device=q.device)
            block_bwd_into(dq_t, dkv_part[pos[kv_row], 0], dkv_part[pos[kv_row], 1], do_j, q_j, kv_chunks[kv_row][0],
                           kv_chunks[kv_row][1], o_j, lse_j, first_q=first_q, first_kv=t == 0, mask=mask,
                           scale=scale, backend=backend, cu_seqlens_q=seg)   # pass 0 meets every chunk first
            if last and u > 0:                       # Alg. 11 line 14: chunk kv_row is final here; pass it on
                if dkv_in is not None:
                    dkv_ring.wait()
                    dkv_part[pos[kv_row]].add_(dkv_in[0])
                dkv_in = dkv_ring.send_recv((dkv_part[pos[kv_row]].to(wire_dtype(R - 1, q.dtype, acc)),))
            if t == 0 and u + 1 < R:                 # the next hop's chunk (grid row i - u - 1) has arrived
                kv_ring.wait()
                kv_chunks[(kv_row - 1) % R] = kv_next[0]
        if t == 0:
            dq_own = dq_t                            # our own queries' dQ: completed at the end
        else:                                        # Alg. 10: the dQ accumulator of this Q block moves on
            if dq_in is not None:
                dq_ring.wait()
                dq_t.add_(dq_in[0])
            dq_in = dq_ring.send_recv((dq_t,))
        if t + 1 < C:
            q_ring.wait()
            blk = nxt
    if C > 1:                                        # our dQ accumulator came home round the row
        dq_ring.wait()
        dq_own.add_(dq_in[0])
    dkv = dkv_part[pos[i]]
    if R > 1:                                        # our chunk's dK, dV came home round the column
        dkv_ring.wait()
        dkv = dkv + dkv_in[0]
    dkv = kv_to_row_major(grid, dkv.to(q.dtype), stats, "backward", inverse=True)   # Alg. 8 line 9
    return dq_own.to(q.dtype), dkv[0], dkv[1]


def attention2d_o(q, k, v, *, group: CPGrid, causal: bool = True, softmax_scale: float, backend: str | None = None,
                  comm_stats: CommStats | None = None, packing=None):
    """Attention2D-O on validated cyclic shards: q [b, s, h, d], k, v [b, s, h_kv, d] -> [b, s, h, d]
    (`packing`: the `_packing.Packing` of a packed sequence, each document cyclic on its own). Shards too short for
    the overlap to pay (`cp_grid.overlap_pays`: 8k tokens or fewer) run Attention2D-NO's schedule, same grid and
    result."""
    own = cp_grid.overlap_pays(q.shape[0] * q.shape[1])
    fwd, bwd = (_forward, _backward) if own else (a2d_no._forward, a2d_no._backward)
    return CPAttention.apply(q, k, v, fwd, bwd, group, causal, softmax_scale, backend, comm_stats, packing)
