"""BurstAttention (burst-attention.txt): ring forward with a global online-softmax merge, and a backward in
which K, V stay put while Q, dQ, dO, D, lse circulate.

Forward: Alg. 1 (GAO): K, V travel the ring; local results merge into (O_i, lse_i) by online softmax; the
local operation is a flash kernel (LAO, Sec. 3.4), so no S or P is ever stored. This is exactly the ring
baseline's forward, so it is `ring.ring_forward`.
Backward: Alg. 2: D_i = rowsum(dO_i o O_i) (line 2); (Q_j, dQ_j, dO_j, D_j, lse_j) travel the ring (line 3-6,
16); each rank recomputes P_{j,i} = exp(S_{j,i} - lse_j) against its own K_i, V_i and accumulates dK_i, dV_i
locally and dQ_j into the travelling accumulator (lines 8-14); dQ_j ends on its owner. We send the dQ
accumulator one step behind Q_j (it is ready only after the compute), which is the same traffic.
Causal balance: the paper's Table 1 has none; here shards are zigzag, so every step is half a block
(`_zigzag.py`) on every rank; packed sequences run the varlen calls of `_zigzag.zigzag_blocks`.
Short shards run in rounds (`ring.round_size`): the forward's as the ring's; in the backward each rank sends its
(Q, dO, D, lse) straight to the next g ranks, two messages a zigzag chunk (Q with D and lse token by token, `QStat`;
dO), and each dQ partial straight to its owner, at most three calls a round;
a dQ partial there is one kernel call's result, summed at its owner in fp32, and travels in the input dtype: a GPU's
fused kernels return it rounded to that dtype inside (cuDNN's convert_dq_to_16bits), so fp32 on the wire would carry
the same values in twice the bytes, plus a cast copy a call (the math backend's fp32 is rounded to it once, as the
ring's dK, dV partials are: docs/design.md, wire precision).

Bytes sent per rank and call (e = element size, n_q = b * s_local * h * d, acc = 4, or 8 for fp64):
  forward  (P - 1) * 2 * n_kv * e                                   (K, V; as ring)
  backward (P - 1) * (n_q * (2 * e + acc) + 2 * b * h * s_local * acc)   (Q, dO; dQ; D, lse)
           (P - 1) * (n_q * 3 * e + 2 * b * h * s_local * acc)          in rounds (g > 1: dQ in the input dtype;
                                                                     QStat's rows padded to 16 bytes at odd h)
                                                                     and at P = 2 (one hop: dQ in the input dtype)
For MHA in fp32 that is 3/4 of ring's backward plus the small D, lse (2/3 in bf16, where both send their
gradient accumulators in fp32; 3/4 in rounds, where both send their partials in bf16). With GQA (h_kv < h) ring
sends less: its K, V are h/h_kv times smaller than Q.
"""
from __future__ import annotations

import torch

from ..comm import CommStats, Exchange, Ring, group_size, wire_dtype
from ..kernels.local_attn import acc_dtype, attention_delta, block_bwd, surrogate_out
from ..kernels.merge import accumulate_, row_sum
from ._function import CPAttention, in_zigzag_order, saving_inputs
from ._zigzag import ALL, chunk_run, zigzag_blocks
from .ring import RoundPartials, n_before, post_round, ring_forward, round_distances, round_size


class QStat:
    """Q and its statistics (D, lse) token by token, one message a zigzag chunk: rows [b, s, W] in q's dtype, Q's
    h d entries, then D and lse of its h heads (acc, reinterpreted as q's dtype: the bits travel unchanged), each row
    padded to 16 bytes so that the kernels' strided Q stays aligned (no padding at even h with d % 8 = 0, the
    shapes a GPU runs). Q and the fp32 statistics travel as one message where they were two; dO stays apart, since
    the cuDNN backward copies a strided dO (`local_attn._cudnn_bwd`) but reads a strided Q in place. At 128k over
    P = 64 (rounds of 16 peers) burst posts 1008 messages a fwd+bwd where it posted 1260, as many as ring."""

    def __init__(self, q: torch.Tensor, acc: torch.dtype):
        self.h, self.d, self.dtype, self.acc = q.shape[2], q.shape[3], q.dtype, acc
        r = max(1, acc.itemsize // q.element_size())             # q elements in one acc
        self.off = -(-self.h * self.d // r) * r             # where the statistics start: an acc boundary
        self.n_stat = 2 * self.h * r
        align = max(r, 16 // q.element_size())
        self.width = -(-(self.off + self.n_stat) // align) * align

    def pack(self, q: torch.Tensor, delta: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """q [b, s, h, d], D and lse [b, h, s] (acc) -> [b, s, W]: one copy of each, written in place."""
        out = q.new_empty(tuple(q.shape[:2]) + (self.width,))
        out[..., :self.h * self.d].copy_(q.flatten(2))
        stat = out[..., self.off:self.off + self.n_stat].view(self.acc).unflatten(-1, (2, self.h))    # [b, s, 2, h]
        stat[:, :, 0].copy_(delta.transpose(1, 2))
        stat[:, :, 1].copy_(lse.transpose(1, 2))
        if self.width > self.off + self.n_stat or self.off > self.h * self.d:     # padding: sent, never read
            out[..., self.h * self.d:self.off].zero_()
            out[..., self.off + self.n_stat:].zero_()
        return out

    def unpack(self, run: torch.Tensor):
        """run [b, n, W] -> Q [b, n, h, d] (a view, row stride W), D and lse [b, h, n] (one copy for both,
        contiguous as the kernels take lse)."""
        q = run[..., :self.h * self.d].unflatten(-1, (self.h, self.d))
        stat = run[..., self.off:self.off + self.n_stat].view(self.acc).unflatten(-1, (2, self.h))   # [b, n, 2, h]
        stat = stat.permute(2, 0, 3, 1).contiguous()
        return q, stat[0], stat[1]


def _round_calls(r: int, dists: list[int], causal: bool) -> list[tuple[int, slice, bool]]:
    """[(query chunk part, round rows, keys: all (True) or the first chunk)] of one backward round on rank r, whose
    K, V meet the Q chunks of the ranks dists behind: a rank before r (dists[i] <= r) shows its second query chunk
    to all of r's keys; one after r both its chunks to r's first chunk (zigzag)."""
    m = len(dists)
    if not causal:
        return [(0, slice(0, m), True)]
    ne = n_before(r, dists)
    calls = [(1, slice(0, ne), True)] if ne else []
    return calls + ([(0, slice(ne, m), False), (1, slice(ne, m), False)] if ne < m else [])


def _backward_rounds(group, do, q, k, v, o, lse, *, causal, scale, backend, stats, g):
    """Alg. 2 in rounds of g ranks (ring.round_size): each rank sends its own (Q, dO, D, lse), chunk by chunk, straight
    to the next g ranks; a round's query chunks meet this rank's K, V in at most three calls; each round's dQ partials
    go straight to their owners, who sum them in fp32 with their own. A partial's every row is one call's result (the
    calls meet disjoint rows), so it travels in the input dtype, at micro-batch 1 as views of the call's output
    (ring.RoundPartials: no fp32 buffer, no cast copy, no zero fill)."""
    ex_q, ex_dq = Exchange(group, "backward", stats), Exchange(group, "backward", stats)
    P, r, s = ex_q.world, ex_q.rank, q.shape[1]
    acc = acc_dtype(q.dtype)
    half = s // 2
    cuts = [slice(0, half), slice(half, None)] if causal else [ALL]
    # line 2: D_i = rowsum(dO_i o O_i), to travel with Q and lse token by token (QStat)
    qstat = QStat(q, acc)
    q_stat = qstat.pack(q, attention_delta(do, o), lse)
    # lines 3-6: ((Q, D, lse), dO) of each chunk, two messages (one run of rows per chunk in a round's buffers)
    mine = [t.contiguous() for c in cuts for t in (q_stat[:, c], do[:, c])]
    rounds = round_distances(P, g)

    nxt = post_round(ex_q, rounds[0], mine)
    dq, dk, dv = (t.to(acc) for t in block_bwd(do, q, k, v, o, lse, mask="causal" if causal else "none",
                                                scale=scale, backend=backend))        # the own block
    back = None                                                  # our dQ partials from the last round's holders
    for i, dists in enumerate(rounds):
        ex_q.wait()
        bufs = nxt
        if i + 1 < len(rounds):
            nxt = post_round(ex_q, rounds[i + 1], mine)
        # the calls write disjoint rows; only the first query chunks of the ranks before r meet none of r's keys
        part = RoundPartials(len(dists), 1, q.shape, cuts, q.dtype)
        for c, sel, all_keys in _round_calls(r, dists, causal):
            q_stat_j, do_j = bufs[2 * c:2 * c + 2]
            ks = ALL if all_keys else cuts[0]
            q_j, delta_j, lse_j = qstat.unpack(chunk_run(q_stat_j, sel))
            # lines 8-14: P = exp(S - lse_j) against this rank's K, V; dV, dK here, dQ_j into its partial
            dq_b, dk_b, dv_b = block_bwd(chunk_run(do_j, sel), q_j, k[:, ks], v[:, ks], None, lse_j,
                                         delta=delta_j, scale=scale, backend=backend)
            accumulate_(dk[:, ks], dk_b)
            accumulate_(dv[:, ks], dv_b)
            part.put(sel, c, (dq_b,))
        if back is not None:
            ex_dq.wait()
            dq += back[:, 0].sum(0, dtype=acc)
        back, sent = part.post_home(ex_dq, dists), part         # line 16: dQ_j home, straight to its owner
    ex_dq.wait()
    dq += back[:, 0].sum(0, dtype=acc)
    del sent
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _backward(group, do, q, k, v, o, lse, *, causal, scale, backend, stats=None, packing=None):
    """Alg. 2: gradients (dq, dk, dv) in the input dtype; K, V never leave this rank."""
    g = round_size(group_size(group), q.shape[1], packing)
    if g > 1:
        return _backward_rounds(group, do, q, k, v, o, lse, causal=causal, scale=scale, backend=backend,
                                stats=stats, g=g)
    ring_q, ring_dq = Ring(group, "backward", stats), Ring(group, "backward", stats)
    P, r, s = ring_q.world, ring_q.rank, q.shape[1]
    acc = acc_dtype(q.dtype)
    # Lines 1-2: dK, dV accumulate here (started by step 0's blocks: no zero-fill); D_i = rowsum(dO_i o O_i).
    dk = dv = None
    delta = attention_delta(do, o)
    blk = (q, do, delta, lse)                                   # line 3: (Q, dO, D, lse) into the ring
    dq_in = None                                                # travelling dQ of the block in hand
    # The travelling dQ is summed into at every hop, so fp32; at P = 2 it makes one hop and, unpacked, holds one
    # kernel call's dQ (one block a step), so it travels in the input dtype (the wire-precision policy, rule 3's
    # exception: on a GPU the values the kernel returned). Packed, a step's calls may share query rows: fp32.
    wire = wire_dtype(P - 1, q.dtype, acc) if packing is None else acc
    for step in range(P):
        if step + 1 < P:                                        # lines 5-6 for the next step, posted early
            nxt = ring_q.send_recv(blk)
        src = (r - step) % P                                    # owner of the Q block in hand
        q_j, do_j, delta_j, lse_j = blk
        dq_blocks, dkv_blocks, surrogates = [], [], {}          # surrogate O of Q rows qs, once per step
        for qs, ks, mask, seg in zigzag_blocks(src, r, s, causal, packing):
            if step == 0:
                o_j = o[:, qs]
            else:
                key = (qs.start, qs.stop)
                if key not in surrogates:
                    surrogates[key] = surrogate_out(do_j[:, qs], delta_j[:, :, qs])
                o_j = surrogates[key]
            # Lines 8-14 with a flash kernel: P = exp(QK^T - lse_j), dV += P^T dO, dS = P o (dO V^T - D), ...
            dq_b, dk_b, dv_b = block_bwd(do_j[:, qs], q_j[:, qs], k[:, ks], v[:, ks], o_j, lse_j[:, :, qs],
                                         mask=mask, scale=scale, backend=backend, cu_seqlens_q=seg)
            if dk is not None:
                accumulate_(dk[:, ks], dk_b)
                accumulate_(dv[:, ks], dv_b)
            else:
                dkv_blocks.append((ks, dk_b, dv_b))
            dq_blocks.append((qs, dq_b))
        if dk is None:                                          # step 0's blocks start dK, dV (no zero-fill)
            dk = row_sum([(ks, x) for ks, x, _ in dkv_blocks], k.shape, acc)
            dv = row_sum([(ks, x) for ks, _, x in dkv_blocks], v.shape, acc)
        if step == 0 or dq_in is None:
            # The own block (step 0): kept here, added at the end. Else the accumulator of Q block src holds the
            # contributions of ranks src+1 .. r-1: none at step 1, so this step's blocks start it.
            dq_acc = row_sum(dq_blocks, q.shape, acc)
        else:
            ring_dq.wait()                                      # after the compute: the transfer overlapped it
            (dq_acc,) = dq_in
            for qs, dq_b in dq_blocks:
                accumulate_(dq_acc[:, qs], dq_b)
        if step == 0:
            dq_own = dq_acc
        else:
            dq_in = ring_dq.send_recv((dq_acc.to(wire),))       # line 16 for dQ_j
        if step + 1 < P:
            ring_q.wait()
            blk = nxt
    if P > 1:                                                   # line 17: dQ_i is home
        ring_dq.wait()
        dq_own += dq_in[0]
    return dq_own.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def burst_attention(q, k, v, *, group, causal: bool = True, softmax_scale: float, backend: str | None = None,
                    comm_stats: CommStats | None = None, packing=None):
    """BurstAttention on validated zigzag shards: q [b, s, h, d], k, v [b, s, h_kv, d] -> [b, s, h, d]
    (`packing`: the `_packing.Packing` of a packed sequence, each document zigzagged on its own)."""
    return in_zigzag_order(packing, causal, q, k, v, lambda q, k, v: CPAttention.apply(
        q, k, v, saving_inputs(ring_forward), _backward, group, causal, softmax_scale, backend, comm_stats, packing))
