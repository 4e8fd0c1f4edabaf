"""All-gather KV attention over the zigzag layout: what TransformerEngine's `cp_comm_type=all_gather` and
PyTorch's native context parallel do.

Forward: K, V of every rank are all-gathered in one collective, posted before the rank computes its own block
(which needs only its own K, V), so that the transfer overlaps it; each rank then computes its two zigzag query
chunks against all of them, one `_zigzag.zigzag_blocks` block per K, V owner (the causal structure expressed
per block: the own block is a triangle, every other half a block, so the work is balanced), merged by online
softmax into fp32 (o, lse) as ring's forward merges its steps.
Backward: K, V are gathered again, overlapped the same way (the forward keeps only the local shard: memory
stays O(s_local)); each rank recomputes its blocks from the global (o, lse), accumulates dQ locally and a dK, dV
partial for every owner in fp32; the partials are summed at their owners (`comm.reduce_at_owner`: each partial
rounded once to the input dtype, one hop, summed in fp32 by the owner, whose own partial is never rounded;
docs/design.md, wire precision, rule 2), what a reduce-scatter computes. Packed sequences run the varlen calls of
`_zigzag.zigzag_blocks` with the local rows in `Packing.zigzag_order`, as ring does.

Design notes from TransformerEngine's `AttnFuncWithCPAndKVAllGather` (Llama 3's CP, looked up, not copied): it
gathers K, V in the forward and again in the backward (as here), and attends each of the two local query chunks
to the prefix of the gathered sequence it sees with a bottom-right-aligned causal mask; it takes no THD input.
Here the prefix is cut at shard boundaries instead, so that every kernel call is a whole block ("none") or a
square "causal" one, which every backend runs, and the same per-block code serves packed documents.

From GROUPED_MIN_P ranks on (unpacked), the blocks that share a mask go in one kernel call: K, V are gathered
as their zigzag chunks (causal: each rank's first and second chunk in collectives of their own, so that the
first chunks of ranks i..j are one contiguous run of keys), and a rank makes at most four calls, whatever P:
its own block (a causal triangle), all rows against the first chunks of the ranks before it, and its second
chunk's rows against the first and against the second chunks of the ranks after it (non-causal: one call over
every key). At P = 64 that is 4 calls a pass where one per owner made 64, each on 1k x 2k tokens at 128k, whose
host time (~100 us a cuDNN backward call) and small-kernel rate bound a rank (docs/performance.md, issue 34).

Bytes sent per rank and call (e = element size, n_kv = b * s_local * h_kv * d):
  forward  (P - 1) * 2 * n_kv * e                 (K, V all-gathered)
  backward (P - 1) * 2 * n_kv * e                 (K, V all-gathered again)
         + (P - 1) * 2 * n_kv * e                 (dK, dV partials, input dtype, summed at the owner)
"""
from __future__ import annotations

import torch

from ..comm import CommStats, all_gather_start, group_rank, group_size, reduce_at_owner
from ..kernels.local_attn import acc_dtype, block_bwd, block_fwd
from ..kernels.merge import merge_
from ._function import CPAttention, in_zigzag_order, saving_inputs
from ._zigzag import ALL, chunk_run, put_run_, zigzag_blocks

GROUPED_MIN_P = 4
"""Ranks from which the grouped calls run: at P = 4 a rank makes at most 4 calls either way, below it the grouped
calls would be more (P = 3, rank 1: 4 against 3)."""


def _grouped(P: int, packing) -> bool:
    return P >= GROUPED_MIN_P and packing is None


def _gather_chunks(group, k, v, causal: bool, stats, phase: str) -> tuple[list[tuple[torch.Tensor, ...]], list]:
    """The grouped calls' keys: [(K, V) of every rank, [P, b, n, h_kv, d]]: causal, the first zigzag chunks
    (n = s / 2) then the second; else the whole shards. Two or four collectives of the stacked path's bytes, posted:
    with them the list to wait for (`_ready`) before reading any."""
    half = k.shape[1] // 2
    cuts = (slice(0, half), slice(half, None)) if causal else (ALL,)
    started = [[all_gather_start(group, t[:, c].contiguous(), stats, phase) for t in (k, v)] for c in cuts]
    return [tuple(out for out, _ in pair) for pair in started], [p for pair in started for _, p in pair]


def _ready(pending: list) -> None:
    """Wait for the posted gathers (the own block's compute overlapped them); then none is pending."""
    for p in pending:
        p.wait()
    pending.clear()


def _grouped_calls(r: int, P: int, s: int, causal: bool) -> list[tuple[slice, int | None, slice, str]]:
    """[(query rows, chunk part (None: this rank's own k, v), owners, mask)] of rank r's grouped calls, the first
    covering every query row. Zigzag: rank i holds chunks i and 2P-1-i; query chunk r sees the chunks before it,
    query chunk 2P-1-r every first chunk and the second chunks of the ranks after r."""
    if not causal:
        return [(ALL, 0, slice(0, P), "none")]
    half = slice(s // 2, None)
    calls = [(ALL, None, slice(r, r + 1), "causal")]
    if r > 0:
        calls.append((ALL, 0, slice(0, r), "none"))
    if r < P - 1:
        calls += [(half, 0, slice(r + 1, P), "none"), (half, 1, slice(r + 1, P), "none")]
    return calls


def _grouped_forward(group, q, k, v, *, causal, scale, backend, stats=None):
    P, r, s = group_size(group), group_rank(group), q.shape[1]
    parts, pending = _gather_chunks(group, k, v, causal, stats, "forward")
    o = lse = None
    for qs, part, owners, mask in _grouped_calls(r, P, s, causal):
        if part is not None:
            _ready(pending)
        kk, vv = (k, v) if part is None else (chunk_run(parts[part][0], owners), chunk_run(parts[part][1], owners))
        o_blk, lse_blk = block_fwd(q[:, qs], kk, vv, mask=mask, scale=scale, backend=backend)
        if o is None:                                                 # the first call covers every row
            o, lse = o_blk.to(acc_dtype(q.dtype)), lse_blk
        else:
            merge_(o[:, qs], lse[:, :, qs], o_blk, lse_blk)
    _ready(pending)
    return o.to(q.dtype), lse


def _grouped_backward(group, do, q, k, v, o, lse, *, causal, scale, backend, stats=None):
    P, r, s = group_size(group), group_rank(group), q.shape[1]
    acc = acc_dtype(q.dtype)
    parts, pending = _gather_chunks(group, k, v, causal, stats, "backward")
    cut = [slice(0, s // 2), slice(s // 2, None)] if causal else [ALL]
    # the calls write disjoint rows of the partials; only the second chunks of the ranks before r are not met
    dkv_part = torch.empty((P, 2) + tuple(k.shape), dtype=acc, device=k.device)
    if causal:
        dkv_part[:r, :, :, cut[1]].zero_()
    dq = None
    for qs, part, owners, mask in _grouped_calls(r, P, s, causal):
        if part is not None:
            _ready(pending)
        kk, vv = (k, v) if part is None else (chunk_run(parts[part][0], owners), chunk_run(parts[part][1], owners))
        dq_b, dk_b, dv_b = block_bwd(do[:, qs], q[:, qs], kk, vv, o[:, qs], lse[:, :, qs], mask=mask, scale=scale,
                                     backend=backend)
        if dq is None:                                                # the first call covers every row
            dq = dq_b.to(acc)
        else:
            dq[:, qs].add_(dq_b)
        ks = ALL if part is None else cut[part]
        for i, g in ((0, dk_b), (1, dv_b)):                           # each owner's rows of this call's keys
            put_run_(dkv_part[owners, i][:, :, ks], g)
    _ready(pending)
    dkv = reduce_at_owner(group, dkv_part, r, q.dtype, stats)        # [2, b, s, h_kv, d] in fp32
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def _forward(group, q, k, v, *, causal, scale, backend, stats=None, packing=None):
    """q [b, s, h, d], k, v [b, s, h_kv, d] (zigzag shards) -> (o in q.dtype, lse [b, h, s] fp32)."""
    P, r, s = group_size(group), group_rank(group), q.shape[1]
    if _grouped(P, packing):
        return _grouped_forward(group, q, k, v, causal=causal, scale=scale, backend=backend, stats=stats)
    kv_all, posted = all_gather_start(group, torch.stack([k, v]), stats)     # [P, 2, b, s, h_kv, d]
    o = lse = None
    for step in range(P):                                             # own block first: it covers every row
        src = (r - step) % P
        kk, vv = (k, v) if step == 0 else (kv_all[src, 0], kv_all[src, 1])    # the own block overlaps the gather
        for qs, ks, mask, seg in zigzag_blocks(r, src, s, causal, packing):
            o_blk, lse_blk = block_fwd(q[:, qs], kk[:, ks], vv[:, ks], mask=mask,
                                       scale=scale, backend=backend, cu_seqlens_q=seg)
            if o is None and qs == ALL:
                o, lse = o_blk.to(acc_dtype(q.dtype)), lse_blk
                continue
            if o is None:                                             # packed causal: the own block in pieces
                o = torch.zeros(q.shape, dtype=acc_dtype(q.dtype), device=q.device)
                lse = torch.full(lse_blk.shape[:2] + (s,), float("-inf"), dtype=o.dtype, device=q.device)
            merge_(o[:, qs], lse[:, :, qs], o_blk, lse_blk)
        if step == 0:
            posted.wait()
    return o.to(q.dtype), lse


def _backward(group, do, q, k, v, o, lse, *, causal, scale, backend, stats=None, packing=None):
    """(dq, dk, dv) in the input dtype from the global (o, lse) of this rank's query rows."""
    P, r, s = group_size(group), group_rank(group), q.shape[1]
    if _grouped(P, packing):
        return _grouped_backward(group, do, q, k, v, o, lse, causal=causal, scale=scale, backend=backend,
                                 stats=stats)
    acc = acc_dtype(q.dtype)
    kv_all, posted = all_gather_start(group, torch.stack([k, v]), stats, "backward")
    # dK, dV partial of every owner's K, V (zero where this rank's queries see none of them).
    dkv_part = torch.zeros((P, 2) + tuple(k.shape), dtype=acc, device=k.device)
    dq = None
    for step in range(P):
        src = (r - step) % P
        kk, vv = (k, v) if step == 0 else (kv_all[src, 0], kv_all[src, 1])    # the own block overlaps the gather
        for qs, ks, mask, seg in zigzag_blocks(r, src, s, causal, packing):
            dq_b, dk_b, dv_b = block_bwd(do[:, qs], q[:, qs], kk[:, ks], vv[:, ks],
                                         o[:, qs], lse[:, :, qs], mask=mask, scale=scale, backend=backend,
                                         cu_seqlens_q=seg)
            if dq is None and qs == ALL:
                dq = dq_b.to(acc)
            else:
                if dq is None:
                    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
                dq[:, qs].add_(dq_b)
            dkv_part[src, 0][:, ks].add_(dk_b)
            dkv_part[src, 1][:, ks].add_(dv_b)
        if step == 0:
            posted.wait()
    dkv = reduce_at_owner(group, dkv_part, r, q.dtype, stats)        # [2, b, s, h_kv, d] in fp32
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def allgather_attention(q, k, v, *, group, causal: bool = True, softmax_scale: float, backend: str | None = None,
                        comm_stats: CommStats | None = None, packing=None):
    """All-gather KV attention on validated zigzag shards: q [b, s, h, d], k, v [b, s, h_kv, d] -> [b, s, h, d]
    (`packing`: the `_packing.Packing` of a packed sequence, each document zigzagged on its own)."""
    return in_zigzag_order(packing, causal, q, k, v, lambda q, k, v: CPAttention.apply(
        q, k, v, saving_inputs(_forward), _backward, group, causal, softmax_scale, backend, comm_stats, packing))
