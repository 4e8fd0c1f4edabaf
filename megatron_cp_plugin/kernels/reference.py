"""Plain-PyTorch reference attention: the unsharded problem, computed naively (full score matrix).

Used by tests (in fp64) to check every kernel and algorithm, and nowhere on a hot path.
"""
from __future__ import annotations

import torch


def attention_reference(q, k, v, *, mask: str = "causal", scale: float | None = None, dtype=torch.float64):
    """q [b, sq, h, d]; k, v [b, sk, h_kv, d] -> (o [b, sq, h, d], lse [b, h, sq]) in `dtype`; differentiable.

    mask: "none", "causal" (key j visible to query i iff j <= i) or "causal_strict" (j < i).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g = q.shape[2] // k.shape[2]
    qq, kk, vv = q.to(dtype), k.to(dtype).repeat_interleave(g, 2), v.to(dtype).repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", qq, kk) * scale
    if mask != "none":
        qi = torch.arange(q.shape[1], device=q.device)[:, None]
        kj = torch.arange(k.shape[1], device=q.device)[None, :]
        visible = kj <= qi if mask == "causal" else kj < qi
        s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
    return torch.einsum("bhqk,bkhd->bqhd", p, vv), lse
