"""DeepSpeed-Ulysses (Jacobs et al. 2023, *DeepSpeed Ulysses: System Optimizations for Enabling Training of
Extreme Long Sequence Transformer Models*): attention parallel over heads after an all-to-all.

Each rank holds a sequence shard of all heads. One all-to-all turns that into all tokens of h / P heads (Q)
and of the K, V heads those queries read; the rank runs ordinary local attention over the whole sequence in
token order (kernels.local_attn.block_fwd / block_bwd, a plain causal or no mask, or the varlen kernel with the
documents' own cu_seqlens when packed); a second all-to-all returns the output to its sequence shard. The
backward is the same: dO all-to-all to heads, the local backward from the saved head-sharded (q, k, v, o, lse),
dQ, dK, dV all-to-all back. Every rank does the same work whatever the mask (all of the sequence, h / P heads),
so the layout need not balance anything: it is the zigzag one, Megatron's own, so that the data path and RoPE
are the ring's, and so that `ulysses_ring.py` can run the ring over groups of ranks on the same shards (a group
of consecutive zigzag ranks holds two zigzag chunks of the group-level sequence). The gathered rows are put in
the order the attention wants by one index, built once per shape (`_order`).

Heads. h % P == 0 is required. GQA: with h_kv % P == 0 each rank gets h_kv / P K, V heads, exactly those its
queries read; with h_kv < P (P % h_kv == 0) each K, V head serves P / h_kv ranks and is sent to each of them
(replicated only as far as needed: one K, V head per rank), and the dK, dV of a replicated head come back from
those ranks and are summed in fp32 at the owner, each partial rounded once to the input dtype (docs/design.md,
wire precision, rule 2). Anything else is a one-line ValueError before any collective (`check_heads`).

Design notes (looked up, not copied): TransformerEngine's `cp_comm_type=a2a` (`AttnFuncWithCPAndQKVOA2A`) and
yunchang's Ulysses attention exchange each of Q, K, V in its own all-to-all and need the KV heads divisible by
the group; here Q, K, V share one all-to-all (comm.all_to_all packs them), as do dQ, dK, dV, and fewer KV heads
than ranks are replicated rather than refused.

Bytes sent per rank and call (e = element size; s = s_local; k_P = h_kv / P, or 1 when h_kv < P; what an
all-to-all over g ranks sends: g - 1 chunks):
  forward  (P - 1) * b * s * d * e * (2 h / P + 2 k_P)     (Q, K, V in; O back)
  backward (P - 1) * b * s * d * e * (2 h / P + 2 k_P)     (dO in; dQ, dK, dV back)
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm import CommStats, all_to_all
from ..kernels.local_attn import acc_dtype, block_bwd, block_fwd
from ..kernels.segments import Segments, to_device
from ._function import CPAttention
from ._packing import Packing, _zigzag_order
from . import ring as _ring


def check_heads(algo: str, h: int, h_kv: int, size: int) -> int:
    """ValueError naming the heads unless an all-to-all over `size` ranks can split them; else the K, V heads
    each rank gets (h_kv / size, or 1 when the K, V heads are replicated)."""
    if h % size:
        raise ValueError(f"heads: algo={algo!r} splits the q heads over its all-to-all of {size} ranks, but "
                         f"{h} q heads are not divisible by {size}")
    if h_kv % size and size % h_kv:
        raise ValueError(f"heads: algo={algo!r} needs k, v heads ({h_kv}) divisible by its all-to-all size {size} "
                         f"or dividing it (replicated)")
    return max(h_kv // size, 1)


@dataclass(frozen=True)
class HeadsPlan:
    """The ranks of one head all-to-all and, for the hierarchical variant, the ring across such groups."""

    a2a: object
    """Process group of the all-to-all (None: one member, nothing to exchange)."""
    size: int
    """U, its members."""
    me: int
    """This rank's index in it."""
    members: tuple[int, ...]
    """The CP-group ranks of its members, in all-to-all order (consecutive ranks)."""
    world: int
    """P, the CP group size."""
    h_kv: int
    """K, V heads of the call (a replicated head's gradients are summed back)."""
    ring: object = None
    """Process group of the ring across the P / U groups (None: no ring)."""
    groups: int = 1
    """G = P / U."""
    ring_rank: int = 0
    """This rank's group index (its rank in the ring)."""

    def order(self, s: int, packing, causal: bool, device):
        """(idx, inv): the received rows [members' shards, concatenated] taken at idx are in the attention's
        order; rows in that order taken at inv are back in the all-to-all's."""
        offs = packing.offsets if packing is not None else None
        idx, inv = _order(self.world * s, offs, self.world, self.members, self.groups, self.ring_rank, causal)
        return _on(idx, device), _on(inv, device)

    def ring_packing(self, packing):
        return Packing.of(packing.offsets, self.groups) if packing is not None else None


@functools.lru_cache(maxsize=64)
def _order(seq_len, offsets, world, members, groups, ring_rank, causal):
    from ..sharding import layout_positions                                      # sharding imports algos

    got = torch.cat([layout_positions(seq_len, "zigzag", rank=p, world_size=world, cu_seqlens=offsets)
                     for p in members])
    # Wanted: this group's rows as a zigzag shard over the G groups (G = 1: token order), which is what
    # `ring.py` expects; packed and causal, in `Packing.zigzag_order` as its caller `in_zigzag_order` gives it.
    want = layout_positions(seq_len, "zigzag", rank=ring_rank, world_size=groups, cu_seqlens=offsets)
    if offsets is not None and causal and groups > 1:
        want = want[_zigzag_order(offsets, groups, torch.device("cpu"))[0]]
    where = torch.full((seq_len,), -1, dtype=torch.long)
    where[got] = torch.arange(got.numel())
    idx = where[want]
    assert idx.numel() == got.numel() and bool((idx >= 0).all()), "the group's tokens differ from the ring's"
    return idx, torch.argsort(idx)


@functools.lru_cache(maxsize=64)
def _on(x, device):
    return to_device(x, device)


def kv_head_index(h_kv: int, size: int) -> torch.Tensor | None:
    """The K, V heads sent to each member in turn (member u gets entries u * k .. (u + 1) * k - 1); None when
    that is every head once, in order (h_kv % size == 0)."""
    if h_kv % size == 0:
        return None
    return torch.arange(size) // (size // h_kv)                 # member u reads K, V head u // (size / h_kv)


def to_heads(plan: HeadsPlan, xs, idx, stats, phase):
    """[(x [b, s, H, d], head index or None)] -> [x' [b, U s, H' / U, d]]: all tokens of the group, this rank's
    heads, rows in the attention's order; one all-to-all for all of them."""
    U = plan.size
    send = []
    for x, heads in xs:
        if heads is not None:
            x = x.index_select(2, heads.to(x.device))
        b, s, H, d = x.shape
        send.append(x.reshape(b, s, U, H // U, d).permute(2, 0, 1, 3, 4))          # [U, b, s, H / U, d]
    out = []
    for r in all_to_all(plan.a2a, send, stats, phase):
        _, b, s, hh, d = r.shape
        out.append(r.transpose(0, 1).reshape(b, U * s, hh, d).index_select(1, idx))
    return out


def to_sequence(plan: HeadsPlan, xs, inv, stats, phase):
    """The inverse of `to_heads`: [x' [b, U s, hh, d]] -> [x [b, s, U hh, d]] (heads in member order)."""
    U = plan.size
    send = []
    for x in xs:
        b, n, hh, d = x.shape
        send.append(x.index_select(1, inv).view(b, U, n // U, hh, d).transpose(0, 1))
    return [r.permute(1, 2, 0, 3, 4).reshape(r.shape[1], r.shape[2], U * r.shape[3], r.shape[4])
            for r in all_to_all(plan.a2a, send, stats, phase)]


def _forward(plan: HeadsPlan, q, k, v, *, causal, scale, backend, stats=None, packing=None):
    idx, inv = plan.order(q.shape[1], packing, causal, q.device)
    heads = kv_head_index(k.shape[2], plan.size)
    q_h, k_h, v_h = to_heads(plan, [(q, None), (k, heads), (v, heads)], idx, stats, "forward")
    if plan.ring is None:                       # all of the sequence here, in token order: one local call
        seg = Segments(packing.offsets) if packing is not None else None
        o_h, lse = block_fwd(q_h, k_h, v_h, mask="causal" if causal else "none", scale=scale, backend=backend,
                             cu_seqlens_q=seg)
    else:                                       # ulysses-ring: the zigzag ring across the groups
        o_h, lse = _ring.ring_forward(plan.ring, q_h, k_h, v_h, causal=causal, scale=scale, backend=backend,
                                      stats=stats, packing=plan.ring_packing(packing))
    (o,) = to_sequence(plan, [o_h], inv, stats, "forward")
    return o, (q_h, k_h, v_h, o_h, lse)


def _backward(plan: HeadsPlan, do, q_h, k_h, v_h, o_h, lse, *, causal, scale, backend, stats=None, packing=None):
    idx, inv = plan.order(do.shape[1], packing, causal, do.device)
    (do_h,) = to_heads(plan, [(do, None)], idx, stats, "backward")
    if plan.ring is None:
        seg = Segments(packing.offsets) if packing is not None else None
        grads = block_bwd(do_h, q_h, k_h, v_h, o_h, lse, mask="causal" if causal else "none", scale=scale,
                          backend=backend, cu_seqlens_q=seg)
    else:
        grads = _ring._backward(plan.ring, do_h, q_h, k_h, v_h, o_h, lse, causal=causal, scale=scale,
                                backend=backend, stats=stats, packing=plan.ring_packing(packing))
    # Rounded to the input dtype once, here; dQ, dK, dV of a head come from one rank, except a replicated K, V
    # head's, whose partials are summed in fp32 at the owner.
    dq, dk, dv = to_sequence(plan, [g.to(do.dtype) for g in grads], inv, stats, "backward")
    heads = kv_head_index(plan.h_kv, plan.size)
    if heads is not None:
        dk, dv = (_sum_replicated(x, plan.h_kv, heads) for x in (dk, dv))
    return dq, dk, dv


def _sum_replicated(dkv, h_kv: int, heads: torch.Tensor):
    """dK or dV [b, s, U, d] of replicated heads (entry u: head heads[u]) -> [b, s, h_kv, d], summed in fp32."""
    acc = acc_dtype(dkv.dtype)
    out = torch.zeros(dkv.shape[:2] + (h_kv, dkv.shape[3]), dtype=acc, device=dkv.device)
    return out.index_add_(2, heads.to(dkv.device), dkv.to(acc)).to(dkv.dtype)


def run_heads(plan: HeadsPlan, q, k, v, causal, softmax_scale, backend, comm_stats, packing):
    """Attention over the head all-to-all of `plan` (ulysses, ulysses-ring), heads already checked."""
    return CPAttention.apply(q, k, v, _forward, _backward, plan, causal, softmax_scale, backend, comm_stats,
                             packing)


def ulysses_attention(q, k, v, *, group, causal: bool = True, softmax_scale: float, backend: str | None = None,
                      comm_stats: CommStats | None = None, packing=None):
    """DeepSpeed-Ulysses on validated zigzag shards: q [b, s, h, d], k, v [b, s, h_kv, d] -> [b, s, h, d]; the
    all-to-all spans the whole group (h % P == 0; h_kv % P == 0 or P % h_kv == 0, else ValueError)."""
    P, r = dist.get_world_size(group), dist.get_rank(group)
    check_heads("ulysses", q.shape[2], k.shape[2], P)             # before any collective
    plan = HeadsPlan(group if P > 1 else None, P, r, tuple(range(P)), P, k.shape[2])
    return run_heads(plan, q, k, v, causal, softmax_scale, backend, comm_stats, packing)
