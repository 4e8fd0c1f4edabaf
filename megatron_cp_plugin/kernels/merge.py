"""The (o, lse) merge: the one place partial attention results are combined.

A partial over a subset of keys is (o, lse): o normalised over that subset, lse its natural-log
log-sum-exp. Two partials merge exactly:
    lse = logaddexp(lse1, lse2),  o = o1 * exp(lse1 - lse) + o2 * exp(lse2 - lse).
Accumulate in fp32 (or fp64): bf16 accumulation across ring steps loses about 2^-9 per step.
A row that saw no key has lse = -inf and o = 0; the merge keeps it finite.
"""
from __future__ import annotations

import torch


def finite_lse(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf replaced by 0, so that `x - lse` never forms -inf - (-inf)."""
    return torch.where(torch.isinf(lse), 0.0, lse)


def merge_(o: torch.Tensor, lse: torch.Tensor, o_blk: torch.Tensor, lse_blk: torch.Tensor) -> None:
    """In place: (o, lse) <- merge((o, lse), (o_blk, lse_blk)).

    o [b, s, h, d] fp32/fp64 accumulator (a view is fine); lse [b, h, s] same dtype family;
    o_blk [b, s, h, d] any float dtype; lse_blk [b, h, s] fp32.

    Five elementwise kernels (six with o_blk's cast), one read and write of o: the block's weight
    exp(lse_blk - lse_new) is sigmoid(lse_blk - lse), the old part's 1 minus it, so o moves toward o_blk by
    lerp. Rows where both are -inf (no key seen yet) give NaN there, zeroed: o stays 0, lse -inf.
    """
    lse_blk = lse_blk.to(lse.dtype)
    w = torch.sub(lse_blk, lse).sigmoid_().nan_to_num_(0.0)            # [b, h, s]
    torch.logaddexp(lse, lse_blk, out=lse)
    o.lerp_(o_blk.to(o.dtype), w.transpose(1, 2).unsqueeze(-1))
