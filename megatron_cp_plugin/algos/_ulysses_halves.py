"""Ulysses on causal zigzag shards by sequence halves: two all-to-alls each way instead of one, so that the first
half of the sequence attends while the second travels, and the second half runs as ring's blocks do.

Member u of the all-to-all holds zigzag chunks u and 2U - 1 - u (each m = s / 2 rows). The first all-to-all
carries every member's first chunk: for its heads a member receives chunks 0 .. U - 1, the first half of the
sequence in token order (at micro-batch 1 the receive buffer itself, no copy). The second carries the second
chunks: U .. 2U - 1, received in reverse member order (one flip copy). Then, with A the first half and B the
second, causal attention over the whole sequence is

    O_A = attn(Q_A, K_A, V_A, causal)                        while the second all-to-all travels; O_A sent back
    O_B = merge(attn(Q_B, K_A, V_A), attn(Q_B, K_B, V_B, causal))

Only the forward: the backward is ulysses' own (one dO all-to-all, one causal call, one all-to-all back). Why
(docs/performance.md, twentieth and twenty-first sessions): one causal forward over the whole sequence runs at
one GPU's causal rate and its all-to-alls were waited for; ring's zigzag steps run half their work as
non-causal blocks, faster. Measured on 2 x H200 at 128k (16 heads, P = 2): the forward by halves 64.0 ms against
68.5 in one call; a backward by the same blocks 177 ms against the one causal call's 171.5 (not profiled: three
calls' preprocessing, dK_A, dV_A summed in fp32 and six casts against one call), so the backward stays one call.
Where it applies: causal, no packed documents, plain ulysses (no ring across groups), one head chunk, the K, V
heads split evenly over the members, and the zigzag layout (`ulysses.by_halves`); everything else takes ulysses' one
all-to-all path.
"""
from __future__ import annotations

import functools

import torch

from ..comm import PostedAllToAll, all_to_all_start
from ..kernels.local_attn import acc_dtype, block_fwd, block_fwd_into
from ..kernels.segments import to_device

ENABLED = True
"""Ulysses' forward takes this schedule where `ulysses.by_halves` says it can (the A/B switch: `bench attention
--seq 131072 --algos ring ulysses` with this True and False)."""


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
    """o [b, s, h, d] and the saved (q_h, k_h, v_h, o_h, lse) of ulysses' one all-to-all path, whose backward
    (`ulysses._backward`) takes it from there."""
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
    # Saved as the one all-to-all path saves them (the halves side by side are the sequence in token order):
    # its backward, one causal call over the whole sequence, runs 5.5 ms faster than these blocks' backward
    # (ring's mix) at 128k over 2 H200s, where the forward by halves is 4.5 ms faster (twenty-first session's A/B)
    saved = tuple(torch.cat(pair, dim=d) for pair, d in (((qa, qb), 1), ((ka, kb), 1), ((va, vb), 1),
                                                         ((oa, ob), 1), ((lse_a, lse_b), 2)))
    back_a.wait()
    back_b.wait()
    return o, saved
