"""Ring attention over the zigzag layout: the baseline, equivalent to TransformerEngine's `cp_comm_type=p2p`.

Forward: K, V travel the ring; each step's block result merges into the running (o, lse) by online softmax
(this is also BurstAttention's forward, Alg. 1 of burst-attention.txt, which `burst.py` reuses).
Backward: K, V travel the ring again, and the dK, dV accumulators of each K, V block travel with it one step
behind, ending on their owner. The next step's send/recv is posted before the current block's compute so the
two overlap on GPU. Packed sequences (cu_seqlens): each step is the varlen calls of `_zigzag.zigzag_blocks`.

Bytes sent per rank and call (e = element size, n_kv = b * s_local * h_kv * d, acc = 4, or 8 for fp64):
  forward  (P - 1) * 2 * n_kv * e                       (K, V)
  backward (P - 1) * 2 * n_kv * (e + acc)               (K, V; dK, dV accumulated in fp32)
The dK, dV accumulators are summed into at every hop, so they travel in fp32 (the wire-precision policy,
docs/design.md). `ring-te` is the same ring with TransformerEngine's p2p byte budget, the baseline users
compare against: the travelling dK, dV in the input dtype, rounded at every hop, backward
(P - 1) * 2 * n_kv * 2e.
"""
from __future__ import annotations

import torch

from ..comm import CommStats, Ring
from ..kernels.local_attn import acc_dtype, block_bwd, block_fwd
from ..kernels.merge import accumulate_, merge_
from ._function import CPAttention, in_zigzag_order, saving_inputs
from ._zigzag import ALL, zigzag_blocks


def ring_forward(group, q, k, v, *, causal, scale, backend, stats=None, packing=None):
    """q [b, s, h, d], k, v [b, s, h_kv, d] (zigzag shards) -> (o [b, s, h, d] in q.dtype, lse [b, h, s] fp32)."""
    ring = Ring(group, "forward", stats)
    P, r, s = ring.world, ring.rank, q.shape[1]
    o = lse = None
    kv = (k, v)
    for step in range(P):
        # Post the next K, V transfer before this step's compute.
        if step + 1 < P:
            nxt = ring.send_recv(kv)
        src = (r - step) % P                                    # owner of the K, V block in hand
        for qs, ks, mask, seg in zigzag_blocks(r, src, s, causal, packing):
            o_blk, lse_blk = block_fwd(q[:, qs], kv[0][:, ks], kv[1][:, ks], mask=mask, scale=scale,
                                       backend=backend, cu_seqlens_q=seg)
            if o is None and qs == ALL:                         # step 0's one block covers every row
                o, lse = o_blk.to(acc_dtype(q.dtype)), lse_blk      # (the kernel's own lse: no copy)
                continue
            if o is None:                                       # packed: step 0 comes in pieces
                o = torch.zeros(q.shape, dtype=acc_dtype(q.dtype), device=q.device)
                lse = torch.full(lse_blk.shape[:2] + (s,), float("-inf"), dtype=o.dtype, device=q.device)
            merge_(o[:, qs], lse[:, :, qs], o_blk, lse_blk)     # online-softmax merge (Alg. 1, lines 13-16)
        if step + 1 < P:
            ring.wait()
            kv = nxt
    return o.to(q.dtype), lse


def _backward(group, do, q, k, v, o, lse, *, causal, scale, backend, stats=None, packing=None, wire=None):
    """Gradients (dq, dk, dv) in the input dtype, from the global o, lse of this rank's query rows; `wire`:
    the dtype the travelling dK, dV accumulators are sent in (None: the accumulator's)."""
    ring_kv, ring_dkv = Ring(group, "backward", stats), Ring(group, "backward", stats)
    P, r, s = ring_kv.world, ring_kv.rank, q.shape[1]
    acc = acc_dtype(q.dtype)
    dq = None
    kv = (k, v)
    dkv_in = None                                               # travelling dK, dV of the block in hand
    for step in range(P):
        if step + 1 < P:
            nxt = ring_kv.send_recv(kv)
        src = (r - step) % P
        dkv_blocks = []
        for qs, ks, mask, seg in zigzag_blocks(r, src, s, causal, packing):
            dq_b, dk_b, dv_b = block_bwd(do[:, qs], q[:, qs], kv[0][:, ks], kv[1][:, ks], o[:, qs], lse[:, :, qs],
                                         mask=mask, scale=scale, backend=backend, cu_seqlens_q=seg)
            if dq is None and qs == ALL:                        # step 0's one block covers every row: no zero-fill
                dq = dq_b.to(acc)
                continue
            if dq is None:                                      # packed: step 0 comes in pieces
                dq = torch.zeros(q.shape, dtype=acc, device=q.device)
            accumulate_(dq[:, qs], dq_b)
            dkv_blocks.append((ks, dk_b, dv_b))
        if step == 0 and not dkv_blocks:
            # Own block (step 0), one call over all keys: its result starts our dK, dV accumulator (kept here,
            # the last hop's sum added at the end).
            dk_acc, dv_acc = dk_b.to(acc), dv_b.to(acc)
        elif wire is not None and step > 0 and len(dkv_blocks) == 1 and dkv_blocks[0][1].dtype == wire:
            # A 16-bit wire and one block (every unpacked step): the hop's sum formed in fp32 and rounded to the
            # wire once, as the fp32 accumulator below would, but in one add into the received buffer (6 bytes an
            # element against 44 for cast, add, cast back; ring-te at P = 16 was 2.6 ms a rank behind ring).
            (ks, dk_b, dv_b), dkv_blocks = dkv_blocks[0], []
            if dkv_in is None:                                  # step 1: nothing travelled into block src yet
                dk_acc, dv_acc = torch.zeros_like(k, dtype=wire), torch.zeros_like(v, dtype=wire)
            else:
                ring_dkv.wait()
                dk_acc, dv_acc = dkv_in
            dk_acc[:, ks] += dk_b                               # sent below as they are (.to(wire): no copy)
            dv_acc[:, ks] += dv_b
        elif step == 0 or dkv_in is None:
            # Packed own block in pieces; or the accumulator of block src, which holds the contributions of
            # ranks src+1 .. r-1: none at step 1.
            dk_acc = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv_acc = torch.zeros_like(dk_acc)
        else:
            ring_dkv.wait()                                     # after the compute: the transfer overlapped it
            dk_acc, dv_acc = (t.to(acc) for t in dkv_in)
        for ks, dk_b, dv_b in dkv_blocks:
            accumulate_(dk_acc[:, ks], dk_b)
            accumulate_(dv_acc[:, ks], dv_b)
        if step == 0:
            dk_own, dv_own = dk_acc, dv_acc
        else:
            # Pass it on (rank r+1 holds block src next step); receive the accumulator of the next block.
            dkv_in = ring_dkv.send_recv((dk_acc, dv_acc) if wire is None else (dk_acc.to(wire), dv_acc.to(wire)))
        if step + 1 < P:
            ring_kv.wait()
            kv = nxt
    if P > 1:                                                   # the last hop brought our own block's sum home
        ring_dkv.wait()
        dk_own += dkv_in[0]
        dv_own += dkv_in[1]
    return dq.to(q.dtype), dk_own.to(k.dtype), dv_own.to(v.dtype)


def ring_attention(q, k, v, *, group, causal: bool = True, softmax_scale: float, backend: str | None = None,
                   comm_stats: CommStats | None = None, packing=None):
    """Zigzag ring attention on validated shards: q [b, s, h, d], k, v [b, s, h_kv, d] -> [b, s, h, d]
    (`packing`: the `_packing.Packing` of a packed sequence, each document zigzagged on its own)."""
    return in_zigzag_order(packing, causal, q, k, v, lambda q, k, v: CPAttention.apply(
        q, k, v, saving_inputs(ring_forward), _backward, group, causal, softmax_scale, backend, comm_stats, packing))


def _backward_te(group, do, q, k, v, o, lse, **kw):
    return _backward(group, do, q, k, v, o, lse, wire=q.dtype, **kw)


def ring_te_attention(q, k, v, *, group, causal: bool = True, softmax_scale: float, backend: str | None = None,
                      comm_stats: CommStats | None = None, packing=None):
    """`ring_attention` with TransformerEngine's p2p byte budget (dK, dV travel in the input dtype): the
    benchmark's and cost model's `ring-te` baseline."""
    return in_zigzag_order(packing, causal, q, k, v, lambda q, k, v: CPAttention.apply(
        q, k, v, saving_inputs(ring_forward), _backward_te, group, causal, softmax_scale, backend, comm_stats, packing))
