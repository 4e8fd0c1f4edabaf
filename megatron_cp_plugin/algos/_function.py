"""The autograd.Function every algorithm runs through: its forward saves what the algorithm's backward needs.

An algorithm supplies fwd(group, q, k, v, *, causal, scale, backend, stats, packing) -> (o, saved tensors) and
bwd(group, do, *saved, causal, scale, backend, stats, packing) -> (dq, dk, dv); `packing` is the validated
`_packing.Packing` of a packed sequence, or None.
"""
from __future__ import annotations

import torch


class CPAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, fwd, bwd, group, causal, scale, backend, stats, packing=None):
        kw = dict(causal=causal, scale=scale, backend=backend, stats=stats, packing=packing)
        o, saved = fwd(group, q, k, v, **kw)
        ctx.save_for_backward(*saved)
        ctx.args = (bwd, group, kw)
        return o

    @staticmethod
    def backward(ctx, do):
        bwd, group, kw = ctx.args
        dq, dk, dv = bwd(group, do, *ctx.saved_tensors, **kw)
        return (dq, dk, dv) + (None,) * 8


def saving_inputs(fwd):
    """Adapt fwd -> (o, lse) to the protocol above, saving (q, k, v, o, lse) for the backward."""
    def wrapped(group, q, k, v, **kw):
        o, lse = fwd(group, q, k, v, **kw)
        return o, (q, k, v, o, lse)
    return wrapped


def in_zigzag_order(packing, causal: bool, q, k, v, run):
    """run(q, k, v) with a packed causal shard's rows in `Packing.zigzag_order` (ring and burst), the output put
    back in the caller's layout; autograd carries the reordering through the backward."""
    if packing is None or not causal or packing.world == 1:
        return run(q, k, v)
    order, inverse = packing.zigzag_order(q.device)
    o = run(*(t.index_select(1, order) for t in (q, k, v)))
    return o.index_select(1, inverse)
