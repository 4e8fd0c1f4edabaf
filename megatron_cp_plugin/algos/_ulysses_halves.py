"""Ulysses on causal zigzag shards by sequence halves: two all-to-alls each way instead of one, so that the first
half of the sequence attends while the second travels, and the second half runs as ring's blocks do.

Member u of the all-to-all holds zigzag chunks u and 2U - 1 - u (each m = s / 2 rows). The first all-to-all
carries every member's first chunk: for its heads a member receives chunks 0 .. U - 1, the first half of the
sequence in token order (at micro-batch 1 the receive buffer itself, no copy). The second carries the second
chunks: U .. 2U - 1, received in reverse member order (one flip copy). Then, with A the first half and B the
second, causal attention over the whole sequence is

    O_A = attn(Q_A, K_A, V_A, causal)                        while the second all-to-all travels; O_A sent back
    O_B = merge(attn(Q_B, K_A, V_A), attn(Q_B, K_B, V_B, causal))

and the backward the same blocks in the same order, dK_A, dV_A summed over two blocks in fp32. Why (docs/
performance.md, twentieth session): one causal call over the whole sequence runs at one GPU's causal rate, and its
all-to-alls were waited for before and after it; ring's zigzag steps run half their work as non-causal blocks.
Where it applies: causal, no packed documents, plain ulysses (no ring across groups), one head chunk, the K, V
heads split evenly over the members, and the zigzag layout (`usable`); everything else takes ulysses' one
all-to-all path.
"""
from __future__ import annotations

import functools

import torch

from ..comm import PostedAllToAll, all_to_all_start
from ..kernels.local_attn import acc_dtype, block_bwd_into, block_fwd, block_fwd_into
from ..kernels.segments import to_device

ENABLED = True
"""Ulysses takes this schedule where `usable` says it can. Not yet timed on a GPU (2026-11-27, written without
device time): the A/B is `bench attention --seq 131072 --algos ring ulysses` with this True and False."""


@functools.lru_cache(maxsize=64)
def zigzag_halves(idx, s: int, U: int) -> bool:
    """Whether `HeadsPlan.order`'s idx (the received rows [members' shards of s rows, concatenated] to take for
    token order) is the zigzag one: member u's first s / 2 rows are chunk u, its last s / 2 chunk 2U - 1 - u."""
    m = s // 2
    if s % 2 or idx.numel() != U * s:
        return False
    want = torch.cat([torch.arange(u * s, u * s + m) for u in range(U)]
                     + [torch.arange(u * s + m, (u + 1) * s) for u in reversed(range(U))])
    return bool(torch.equal(idx.cpu(), want))


def _in(plan, xs, flip: bool, stats, phase) -> PostedAllToAll:
    """xs [b, m, H, d] (one chunk of rows of this member, every head) -> posted; `.wait()` gives [b, U m, H / U, d]
    each: this member's heads, the U members' chunks side by side (flip: in reverse member order). One all-to-all
    a tensor, all posted at once: each receive buffer is then that tensor's alone, [U, b, m, hh, d], and at b = 1
    unflipped already the rows in token order (a view, no copy)."""
    U = plan.size

    def rows(parts):
        (r,) = parts                                                # [U, b, m, hh, d]
        r = r.flip(0) if flip else r
        return r.transpose(0, 1).reshape(r.shape[1], -1, *r.shape[3:])
    posted = [all_to_all_start(plan.a2a, [x.reshape(*x.shape[:2], U, x.shape[2] // U, x.shape[3])
                                          .permute(2, 0, 1, 3, 4)], stats, phase).then(rows) for x in xs]
    return PostedAllToAll(None, lambda: [p.wait() for p in posted])


@functools.lru_cache(maxsize=64)
def _half_order(U: int, m: int, flip: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx, inv) in `ulysses.HeadsPlan.order`'s sense for one half on its way back: its rows [U m] hold chunk j
    at j m .. (j + 1) m - 1, which goes to member j (flip: U - 1 - j)."""
    members = reversed(range(U)) if flip else range(U)
    idx = torch.cat([torch.arange(u * m, (u + 1) * m) for u in members])
    return to_device(idx, device), to_device(torch.argsort(idx), device)


def _out(plan, xs, dsts, flip: bool, stats, phase) -> PostedAllToAll:
    """The inverse of `_in`: xs [b, U m, hh, d] -> dsts [b, m, H, d] (written after `.wait()`), through ulysses'
    own way back (`to_sequence`: each member's chunk written straight into the send buffer)."""
    from .ulysses import to_sequence                                # ulysses imports this module
    order = _half_order(plan.size, xs[0].shape[1] // plan.size, flip, xs[0].device)
    return to_sequence(plan, [(x, None) for x in xs], order, stats, phase, dsts)


def forward(plan, q, k, v, *, scale, backend, stats=None):
    """o [b, s, h, d] and the saved (Q_A, K_A, V_A, O_A, lse_A, Q_B, K_B, V_B, O_B, lse_B)."""
    m = q.shape[1] // 2
    first = _in(plan, [q[:, :m], k[:, :m], v[:, :m]], False, stats, "forward")
    second = _in(plan, [q[:, m:], k[:, m:], v[:, m:]], True, stats, "forward")
    o = q.new_empty(q.shape)
    # O_A: the first half, causal, while the second half's Q, K, V travel; sent back while O_B is computed
    qa, ka, va = first.wait()
    oa, lse_a = block_fwd(qa, ka, va, mask="causal", scale=scale, backend=backend)
    back_a = _out(plan, [oa], [o[:, :m]], False, stats, "forward")
    # O_B = merge(attn(Q_B, K_A, V_A), attn(Q_B, K_B, V_B, causal)) in fp32, rounded once
    qb, kb, vb = second.wait()
    ob_acc = torch.empty(qb.shape, dtype=acc_dtype(q.dtype), device=q.device)
    lse_b = torch.empty(qb.shape[0], qb.shape[2], qb.shape[1], dtype=lse_a.dtype, device=q.device)
    block_fwd_into(ob_acc, lse_b, qb, ka, va, first=True, mask="none", scale=scale, backend=backend)
    block_fwd_into(ob_acc, lse_b, qb, kb, vb, first=False, mask="causal", scale=scale, backend=backend)
    ob = ob_acc.to(q.dtype)
    back_b = _out(plan, [ob], [o[:, m:]], True, stats, "forward")
    back_a.wait()
    back_b.wait()
    return o, (qa, ka, va, oa, lse_a, qb, kb, vb, ob, lse_b)


def backward(plan, do, qa, ka, va, oa, lse_a, qb, kb, vb, ob, lse_b, *, scale, backend, stats=None):
    """dq, dk, dv [b, s, ., d] of `forward`'s blocks, in the same order: A's causal block while dO_B travels,
    then B against A (dK_A, dV_A complete: sent back), then B's causal block."""
    b, s, h, d = do.shape
    m = s // 2
    first = _in(plan, [do[:, :m]], False, stats, "backward")
    second = _in(plan, [do[:, m:]], True, stats, "backward")
    acc = acc_dtype(do.dtype)
    dq, dk, dv = do.new_empty(do.shape), do.new_empty((b, s, plan.h_kv, d)), do.new_empty((b, s, plan.h_kv, d))
    (do_a,) = first.wait()
    dqa, dka, dva = (torch.empty(t.shape, dtype=acc, device=do.device) for t in (qa, ka, va))
    block_bwd_into(dqa, dka, dva, do_a, qa, ka, va, oa, lse_a, first_q=True, first_kv=True, mask="causal",
                   scale=scale, backend=backend)
    (do_b,) = second.wait()
    dqb, dkb, dvb = (torch.empty(t.shape, dtype=acc, device=do.device) for t in (qb, kb, vb))
    block_bwd_into(dqb, dka, dva, do_b, qb, ka, va, ob, lse_b, first_q=True, first_kv=False, mask="none",
                   scale=scale, backend=backend)
    back_a = _out(plan, [t.to(do.dtype) for t in (dqa, dka, dva)], [dq[:, :m], dk[:, :m], dv[:, :m]], False,
                  stats, "backward")
    block_bwd_into(dqb, dkb, dvb, do_b, qb, kb, vb, ob, lse_b, first_q=False, first_kv=True, mask="causal",
                   scale=scale, backend=backend)
    back_b = _out(plan, [t.to(do.dtype) for t in (dqb, dkb, dvb)], [dq[:, m:], dk[:, m:], dv[:, m:]], True,
                  stats, "backward")
    back_a.wait()
    back_b.wait()
    return dq, dk, dv
