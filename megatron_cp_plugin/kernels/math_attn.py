"""The math attention kernel: chunked PyTorch on any device and dtype, fp32 accumulation (fp64 for fp64), the
reference of the fused kernels and the CPU default (`local_attn` dispatches to it as backend "math").

Memory is bounded by chunk x chunk scores per head. Its backward keeps the fused kernels' contract: D =
rowsum(dO * O) is formed from the O it is handed. Packed blocks (`math_segments`) mask keys of other segments
and skip chunks that hold none of a query chunk's segments.
"""
from __future__ import annotations

import torch

from .merge import finite_lse, merge_
from .segments import Segments


def attention_delta(do: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """D = rowsum(dO * O) in fp32 (fp64 for fp64): [b, s, h, d] x2 -> [b, h, s] (contiguous).

    Three passes: dO's cast, the product (O upcast exactly as it is read), the sum over d of the product seen as
    [b, h, s, d], which lands in [b, h, s] order (no transposed copy)."""
    acc = acc_dtype(o.dtype)
    return torch.mul(do.to(acc), o).permute(0, 2, 1, 3).sum(-1)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulator (and lse) dtype for inputs of `dtype`: fp64 for fp64, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def empty_result(q):
    """(o, lse) of rows that see no key: o = 0, lse = -inf."""
    b, sq, h, _ = q.shape
    return torch.zeros_like(q), torch.full((b, h, sq), float("-inf"), dtype=acc_dtype(q.dtype), device=q.device)


def math_segments(sq: Segments, sk: Segments, device):
    """What the math kernel needs of a packed block: the segments and each row's (segment, position)."""
    return (sq, sk) + sq.ids(device) + sk.ids(device)


def _key_span(i0, i1, sk_rows, causal, segs):
    """[j0, j1): the keys query rows [i0, i1) can see at all (chunks outside it are skipped)."""
    hi = min(sk_rows, i1) if causal is True else sk_rows
    if segs is None:
        return 0, hi
    sq, sk = segs[0], segs[1]
    first, last = sq.segment_of(i0), sq.segment_of(i1 - 1)
    return sk.offsets[first], min(hi, sk.offsets[last + 1])


def _scores(qc, kc, scale, causal, i0, j0, segs=None):
    """qc [b, cq, hk, g, d], kc [b, ck, hk, d] -> masked scores [b, hk, g, cq, ck]; `causal` is a bool or a
    visibility tensor [b, sq, sk] of the whole block; `segs` (`math_segments`): keys only of the same segment,
    causal by position inside it."""
    s = torch.einsum("bqhgd,bkhd->bhgqk", qc, kc) * scale
    if segs is not None:
        q_id, q_pos, k_id, k_pos = (x[a:a + n] for x, a, n in zip(segs[2:], (i0, i0, j0, j0),
                                                                  (qc.shape[1],) * 2 + (kc.shape[1],) * 2))
        vis = q_id[:, None] == k_id[None, :]
        if causal:
            vis &= k_pos[None, :] <= q_pos[:, None]
        s = s.masked_fill(~vis, float("-inf"))
    elif isinstance(causal, torch.Tensor):
        vis = causal[:, i0:i0 + qc.shape[1], j0:j0 + kc.shape[1]]
        s = s.masked_fill(~vis[:, None, None], float("-inf"))
    elif causal:
        qi = torch.arange(i0, i0 + qc.shape[1], device=qc.device)
        kj = torch.arange(j0, j0 + kc.shape[1], device=qc.device)
        s = s.masked_fill(kj[None, :] > qi[:, None], float("-inf"))
    return s


def math_fwd(q, k, v, causal, scale, chunk, segs=None):
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g, acc = h // hk, acc_dtype(q.dtype)
    o = torch.zeros(b, sq, h, d, dtype=acc, device=q.device)
    lse = torch.full((b, h, sq), float("-inf"), dtype=acc, device=q.device)
    for i0 in range(0, sq, chunk):
        i1 = min(i0 + chunk, sq)
        qc = q[:, i0:i1].to(acc).reshape(b, i1 - i0, hk, g, d)
        j_lo, j_hi = _key_span(i0, i1, sk, causal, segs)
        for j0 in range(j_lo, j_hi, chunk):
            j1 = min(j0 + chunk, sk if segs is None else j_hi)
            s = _scores(qc, k[:, j0:j1].to(acc), scale, causal, i0, j0, segs)
            m = finite_lse(s.amax(-1, keepdim=True))
            p = torch.exp(s - m)
            l = p.sum(-1)                                                     # [b, hk, g, cq]
            oc = torch.einsum("bhgqk,bkhd->bqhgd", p, v[:, j0:j1].to(acc))
            oc = oc / l.clamp_min(torch.finfo(acc).tiny).permute(0, 3, 1, 2).unsqueeze(-1)
            lc = (m.squeeze(-1) + torch.log(l)).reshape(b, h, i1 - i0)
            merge_(o[:, i0:i1], lse[:, :, i0:i1], oc.reshape(b, i1 - i0, h, d), lc)
    return o.to(q.dtype), lse


def math_bwd(do, q, k, v, o, lse, causal, scale, chunk, segs=None):
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g, acc = h // hk, acc_dtype(q.dtype)
    delta = attention_delta(do, o)                  # from O, as the fused kernels do
    # Rows that saw no key anywhere have lse = -inf and all scores -inf: +inf makes exp(s - lse) = 0.
    lse_b = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse).to(acc)
    dq = torch.zeros(b, sq, hk, g, d, dtype=acc, device=q.device)
    dk = torch.zeros(b, sk, hk, d, dtype=acc, device=q.device)
    dv = torch.zeros(b, sk, hk, d, dtype=acc, device=q.device)
    for i0 in range(0, sq, chunk):
        i1 = min(i0 + chunk, sq)
        qc = q[:, i0:i1].to(acc).reshape(b, i1 - i0, hk, g, d)
        doc = do[:, i0:i1].to(acc).reshape(b, i1 - i0, hk, g, d)
        lc = lse_b[:, :, i0:i1].reshape(b, hk, g, i1 - i0, 1)
        dc = delta[:, :, i0:i1].to(acc).reshape(b, hk, g, i1 - i0, 1)
        j_lo, j_hi = _key_span(i0, i1, sk, bool(causal), segs)
        for j0 in range(j_lo, j_hi, chunk):
            j1 = min(j0 + chunk, sk if segs is None else j_hi)
            kc, vc = k[:, j0:j1].to(acc), v[:, j0:j1].to(acc)
            p = torch.exp(_scores(qc, kc, scale, causal, i0, j0, segs) - lc)     # P = exp(S - lse)
            dv[:, j0:j1] += torch.einsum("bhgqk,bqhgd->bkhd", p, doc)           # dV += P^T dO
            dp = torch.einsum("bqhgd,bkhd->bhgqk", doc, vc)                     # dP = dO V^T
            ds = p * (dp - dc) * scale                                          # dS = P o (dP - D)
            dq[:, i0:i1] += torch.einsum("bhgqk,bkhd->bqhgd", ds, kc)           # dQ += dS K
            dk[:, j0:j1] += torch.einsum("bhgqk,bqhgd->bkhd", ds, qc)           # dK += dS^T Q
    return dq.reshape(b, sq, h, d), dk, dv
