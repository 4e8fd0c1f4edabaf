"""The autograd.Function every algorithm runs through: its forward saves what the algorithm's backward needs.

An algorithm supplies fwd(group, q, k, v, *, causal, scale, backend, stats) -> (o, saved tensors) and
bwd(group, do, *saved, causal, scale, backend, stats) -> (dq, dk, dv).
"""
from __future__ import annotations

import torch


class CPAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, fwd, bwd, group, causal, scale, backend, stats):
        o, saved = fwd(group, q, k, v, causal=causal, scale=scale, backend=backend, stats=stats)
        ctx.save_for_backward(*saved)
        ctx.args = (bwd, group, dict(causal=causal, scale=scale, backend=backend, stats=stats))
        return o

    @staticmethod
    def backward(ctx, do):
        bwd, group, kw = ctx.args
        dq, dk, dv = bwd(group, do, *ctx.saved_tensors, **kw)
        return (dq, dk, dv) + (None,) * 7


def saving_inputs(fwd):
    """Adapt fwd -> (o, lse) to the protocol above, saving (q, k, v, o, lse) for the backward."""
    def wrapped(group, q, k, v, **kw):
        o, lse = fwd(group, q, k, v, **kw)
        return o, (q, k, v, o, lse)
    return wrapped
