"""Plain-PyTorch reference attention: the unsharded problem, computed naively (full score matrix).

Used by tests (in fp64) to check every kernel and algorithm, and nowhere on a hot path.
"""
from __future__ import annotations

import torch


def _segment_ids(cu_seqlens, n: int, device) -> torch.Tensor:
    """Document index of each of the n rows, from cumulative boundaries [n_docs + 1] (tensor or sequence)."""
    offs = torch.as_tensor(cu_seqlens, dtype=torch.long).flatten().cpu()
    if offs[0] != 0 or offs[-1] != n or (offs[1:] < offs[:-1]).any():
        raise ValueError(f"cu_seqlens must run from 0 to {n}, non-decreasing; got {offs.tolist()[:8]}")
    return torch.repeat_interleave(torch.arange(len(offs) - 1), offs[1:] - offs[:-1]).to(device)


def attention_reference(q, k, v, *, mask: str = "causal", scale: float | None = None, dtype=torch.float64,
                        cu_seqlens_q=None, cu_seqlens_k=None):
    """q [b, sq, h, d]; k, v [b, sk, h_kv, d] -> (o [b, sq, h, d], lse [b, h, sq]) in `dtype`; differentiable.

    mask: "none", "causal" (key j visible to query i iff j <= i) or "causal_strict" (j < i).
    cu_seqlens_q / _k (varlen; _k defaults to _q): packed documents; query document i sees key document i only,
    and the mask compares positions inside the document. A row that sees no key: o = 0, lse = -inf.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g = q.shape[2] // k.shape[2]
    qq, kk, vv = q.to(dtype), k.to(dtype).repeat_interleave(g, 2), v.to(dtype).repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", qq, kk) * scale
    qi = torch.arange(q.shape[1], device=q.device)[:, None]
    kj = torch.arange(k.shape[1], device=q.device)[None, :]
    visible = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device)
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        cq = cu_seqlens_q if cu_seqlens_q is not None else cu_seqlens_k
        ck = cu_seqlens_k if cu_seqlens_k is not None else cu_seqlens_q
        dq_, dk_ = _segment_ids(cq, q.shape[1], q.device), _segment_ids(ck, k.shape[1], q.device)
        starts_q = torch.as_tensor(cq, dtype=torch.long).flatten().to(q.device)[dq_]
        starts_k = torch.as_tensor(ck, dtype=torch.long).flatten().to(q.device)[dk_]
        visible = dq_[:, None] == dk_[None, :]
        qi, kj = qi - starts_q[:, None], kj - starts_k[None, :]        # positions inside the document
    if mask != "none":
        visible = visible & ((kj <= qi) if mask == "causal" else (kj < qi))
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
    return torch.einsum("bhqk,bkhd->bqhd", p, vv), lse
