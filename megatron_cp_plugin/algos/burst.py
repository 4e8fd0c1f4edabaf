"""BurstAttention (burst-attention.txt): ring forward with a global online-softmax merge, and a backward in
which K, V stay put while Q, dQ, dO, D, lse circulate.

Forward: Alg. 1 (GAO): K, V travel the ring; local results merge into (O_i, lse_i) by online softmax; the
local operation is a flash kernel (LAO, Sec. 3.4), so no S or P is ever stored. This is exactly the ring
baseline's forward, so it is `ring._forward`.
Backward: Alg. 2: D_i = rowsum(dO_i o O_i) (line 2); (Q_j, dQ_j, dO_j, D_j, lse_j) travel the ring (line 3-6,
16); each rank recomputes P_{j,i} = exp(S_{j,i} - lse_j) against its own K_i, V_i and accumulates dK_i, dV_i
locally and dQ_j into the travelling accumulator (lines 8-14); dQ_j ends on its owner. We send the dQ
accumulator one step behind Q_j (it is ready only after the compute), which is the same traffic.
Causal balance: the paper's Table 1 has none; here shards are zigzag, so every step is half a block
(`_zigzag.py`) on every rank.

Bytes sent per rank and call (e = element size, n_q = b * s_local * h * d, acc = 4, or 8 for fp64):
  forward  (P - 1) * 2 * n_kv * e                                   (K, V; as ring)
  backward (P - 1) * (n_q * (2 * e + acc) + 2 * b * h * s_local * acc)   (Q, dO; dQ; D, lse)
For MHA in fp32 that is 3/4 of ring's backward plus the small D, lse (2/3 in bf16, where both send their
gradient accumulators in fp32). With GQA (h_kv < h) ring sends less: its K, V are h/h_kv times smaller than Q.
"""
from __future__ import annotations

import torch

from ..comm import CommStats, Ring
from ..kernels.local_attn import acc_dtype, attention_delta, block_bwd
from ._function import CPAttention, saving_inputs
from ._zigzag import zigzag_pair
from .ring import _forward


def _backward(group, do, q, k, v, o, lse, *, causal, scale, backend, stats=None):
    """Alg. 2: gradients (dq, dk, dv) in the input dtype; K, V never leave this rank."""
    ring_q, ring_dq = Ring(group, "backward", stats), Ring(group, "backward", stats)
    P, r, s = ring_q.world, ring_q.rank, q.shape[1]
    acc = acc_dtype(q.dtype)
    # Lines 1-2: dK, dV accumulate here; D_i = rowsum(dO_i o O_i).
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros_like(dk)
    delta = attention_delta(do, o)
    blk = (q, do, delta, lse)                                   # line 3: (Q, dO, D, lse) into the ring
    dq_in = None                                                # travelling dQ of the block in hand
    for step in range(P):
        if step + 1 < P:                                        # lines 5-6 for the next step, posted early
            nxt = ring_q.send_recv(blk)
        src = (r - step) % P                                    # owner of the Q block in hand
        q_j, do_j, delta_j, lse_j = blk
        qs, ks, mask = zigzag_pair(src, r, s, causal)
        # Lines 8-14 with a flash kernel: P = exp(QK^T - lse_j), dV += P^T dO, dS = P o (dO V^T - D), ...
        dq_b, dk_b, dv_b = block_bwd(do_j[:, qs], q_j[:, qs], k[:, ks], v[:, ks], o[:, qs] if step == 0 else None,
                                     lse_j[:, :, qs], delta=delta_j[:, :, qs], mask=mask, scale=scale,
                                     backend=backend)
        dk[:, ks].add_(dk_b)
        dv[:, ks].add_(dv_b)
        if step == 0:
            dq_own = dq_b.to(acc)                               # own block: kept here, added at the end
        else:
            # The accumulator of Q block src holds the contributions of ranks src+1 .. r-1 (none at step 1).
            if dq_in is None:
                dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
            else:
                ring_dq.wait()
                (dq_acc,) = dq_in
            dq_acc[:, qs].add_(dq_b)
            dq_in = ring_dq.send_recv((dq_acc,))                # line 16 for dQ_j
        if step + 1 < P:
            ring_q.wait()
            blk = nxt
    if P > 1:                                                   # line 17: dQ_i is home
        ring_dq.wait()
        dq_own += dq_in[0]
    return dq_own.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def burst_attention(q, k, v, *, group, causal: bool = True, softmax_scale: float, backend: str | None = None,
                    comm_stats: CommStats | None = None):
    """BurstAttention on validated zigzag shards: q [b, s, h, d], k, v [b, s, h_kv, d] -> [b, s, h, d]."""
    return CPAttention.apply(q, k, v, saving_inputs(_forward), _backward, group, causal, softmax_scale, backend,
                             comm_stats)
