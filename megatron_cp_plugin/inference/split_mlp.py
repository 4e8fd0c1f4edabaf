"""The decode step's MLPs split over the context-parallel ranks: each rank reads 1/P of every MLP's weights a token.

Why: under context parallelism every rank holds the whole model, and a decode step at batch 1-8 is bound by the
bytes it reads, so every rank reads every weight every token while only its KV shard shrinks with P. For the 8B
shape (hidden 4096, ffn 14336) the MLPs are 7.5 of the 10.2 GB of weights; at CP = 2 and 128k the weights are 54 %
of a rank's floor, which capped CP = 2 at 1.46x CP = 1's tokens/s (docs/decode.md). The ranks of the CP group hold
the same token's hidden state, so they can split each MLP as Megatron-LM's tensor parallelism does (Shoeybi et al.
2019, section 3: fc1 column-parallel, fc2 row-parallel, one all-reduce a layer): rank r computes fc1's output
features [F r / P, F (r + 1) / P) (for a gated unit, those of the gate and of the up projection) and multiplies them
with fc2's matching columns into an fp32 partial of the layer's output; the partials are summed on every rank in
one small all-reduce (b x hidden fp32, 16 kB at batch 1), which also adds fc2's bias and the residual and rounds
once. A rank then reads (attention weights + MLP / P), at one reduce a layer: over NVLink the `peer` kernel
(kernels/peer_sum.py: 9.8 us a call on 2 x H100, its two flag rounds included), elsewhere the group's all_reduce.

Numbers: the fp32 partials are summed in rank order 0 .. P-1 on every rank (peer_sum) or by the collective, which
gives every rank the same bits; against the whole MLP the sum runs in another order, so the result differs in the
last bits (as any change of GEMV blocking does). Memory: fc1 and fc2 slices are views of the model's weights
(no copy), except a gated fc1, whose two row ranges are copied into one [2 F / P, hidden] tensor at set-up.

    split = SplitMLPs(model, group, rows=batch, peer=True)   # at the decoder's set-up: a collective where peer
    with swapped(model, ..., split=split): ...               # hooks.swapped puts SplitFC1 / SplitFC2 in place
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..kernels import gemv as _gemv


def splittable_mlps(model) -> list:
    """megatron-core MLPs of `model` whose fc1 and fc2 are one tensor-parallel rank's whole linears (not experts,
    not TE's fused norm-linear): the ones SplitMLPs can split."""
    from .hooks import _one_rank_linear

    return [m for m in model.modules()
            if _one_rank_linear(getattr(m, "linear_fc1", None)) and _one_rank_linear(getattr(m, "linear_fc2", None))]


def _bounds(n: int, world: int, rank: int) -> slice:
    """Rank `rank`'s share of n features: [n r / P, n (r + 1) / P) (uneven where P does not divide n)."""
    return slice(n * rank // world, n * (rank + 1) // world)


class _Reduce:
    """Sums every rank's fp32 [rows, n] partial (`buf`, written by fc2's GEMV) into out, + bias, + residual, rounded
    once: peer_sum over symmetric buffers, or the group's all_reduce then three adds."""

    def __init__(self, group, rows: int, n: int, acc: torch.dtype, device, peer: bool):
        self.group, self.rows, self.n, self.bufs = group, rows, n, None
        if peer:
            from ..symmetric import peer_buffers

            self.bufs = peer_buffers(group, rows * n, device)
            self.buf = self.bufs.data[:rows * n].view(rows, n)
        else:
            self.buf = torch.empty(rows, n, dtype=acc, device=device)

    def __call__(self, out: torch.Tensor, bias, residual) -> torch.Tensor:
        """out: contiguous, rows x n elements of the layer's dtype (returned); residual: as many, or None."""
        flat = out.view(self.rows, self.n)
        residual = None if residual is None else residual.reshape(self.rows, self.n)
        if self.bufs is not None:
            from ..kernels.peer_sum import peer_sum

            peer_sum(self.bufs, self.rows, self.n, flat, bias=bias, residual=residual)
            return out
        if self.group.size() > 1:
            dist.all_reduce(self.buf, group=self.group)
        y = self.buf
        if bias is not None:
            y = y + bias.to(y.dtype)
        if residual is not None:
            y = y + residual.to(y.dtype)
        flat.copy_(y)
        return out


class SplitMLPs:
    """This rank's share of every splittable MLP of `model` (splittable_mlps) and the reduce they share.

    group: the context-parallel group (every rank holds the same weights and the same token); rows: the step's
    rows (batch x 1 new token); peer: sum over NVLink symmetric memory (the caller checked that it can: NCCL, one
    node, one GPU a rank; symmetric.unsupported_reason), else with the group's all_reduce."""

    def __init__(self, model, group, *, rows: int, peer: bool):
        self.mlps = splittable_mlps(model)
        if not self.mlps:
            raise ValueError("mlp='split' needs megatron-core MLPs of one tensor-parallel rank (linear_fc1, "
                             "linear_fc2 of the local spec); this model has none")
        self.world, self.rank = group.size(), group.rank()
        fc2 = self.mlps[0].linear_fc2.weight
        acc = torch.float64 if fc2.dtype == torch.float64 else torch.float32
        self.reduce = _Reduce(group, rows, fc2.shape[0], acc, fc2.device, peer)
        self.fc1_weight, self.fc1_bias, self.fc2_weight = [], [], []
        for m in self.mlps:
            w1, b1, w2 = m.linear_fc1.weight, m.linear_fc1.bias, m.linear_fc2.weight
            ffn = w2.shape[1]
            cols = _bounds(ffn, self.world, self.rank)
            if w1.shape[0] == 2 * ffn:            # gated: [gate; up], each rank takes the same features of both
                take = torch.cat([torch.arange(cols.start, cols.stop), ffn + torch.arange(cols.start, cols.stop)])
                take = take.to(w1.device)
                self.fc1_weight.append(w1.detach().index_select(0, take))
                self.fc1_bias.append(None if b1 is None else b1.detach().index_select(0, take))
            else:
                self.fc1_weight.append(w1.detach()[cols])
                self.fc1_bias.append(None if b1 is None else b1.detach()[cols])
            self.fc2_weight.append(w2.detach()[:, cols])

    def weight_bytes_saved(self) -> int:
        """Bytes of MLP parameters this rank no longer reads a step (fc1's weight and bias, fc2's weight, less its
        shares; the decode floor's weights shrink by this)."""
        def nbytes(t):
            return 0 if t is None else t.numel() * t.element_size()

        whole = sum(nbytes(m.linear_fc1.weight) + nbytes(m.linear_fc1.bias) + nbytes(m.linear_fc2.weight)
                    for m in self.mlps)
        return whole - sum(map(nbytes, self.fc1_weight + self.fc1_bias + self.fc2_weight))

    def close(self) -> None:
        self.reduce = None


class SplitFC1(torch.nn.Module):
    """Stands in for an MLP's linear_fc1: this rank's output features (SplitMLPs), through kernels/gemv.py (its
    reference off CUDA). gelu: bias and exact GELU in the kernel (the MLP's activation is the identity then, as
    hooks.FusedLinear); else the bias is added here unless the layer returns it apart (skip_bias_add), as its own."""

    def __init__(self, inner, weight, bias, *, gelu: bool):
        super().__init__()
        self.inner, self.weight, self.bias, self.gelu = inner, weight, bias, gelu

    def forward(self, x, *args, **kwargs):
        apart = self.inner.skip_bias_add and not self.gelu
        y = _gemv.gemv(x, self.weight, None if apart else self.bias, gelu=self.gelu)
        return y, (self.bias if apart else None)


class SplitFC2(torch.nn.Module):
    """Stands in for an MLP's linear_fc2: this rank's columns into the shared fp32 partial, then the reduce over the
    group with fc2's bias and, with a ResidualLink (hooks.py), the residual added in the same pass; returns the
    layer's output with no separate bias."""

    def __init__(self, inner, weight, reduce: _Reduce, link=None):
        super().__init__()
        self.inner, self.weight, self.reduce_, self.link = inner, weight, reduce, link

    def forward(self, x, *args, **kwargs):
        red, link = self.reduce_, self.link
        rows = x.numel() // x.shape[-1]
        if rows != red.rows:
            raise ValueError(f"the split MLP was set up for {red.rows} rows (batch x 1 new token), got {rows}")
        _gemv.gemv(x.reshape(rows, -1), self.weight, None, out=red.buf)
        out_shape = (*x.shape[:-1], self.weight.shape[0])
        res = link.residual if link is not None else None
        if res is not None and (res.dtype != x.dtype or tuple(res.shape) != out_shape):
            res = None
        out = red(torch.empty(out_shape, dtype=x.dtype, device=x.device), self.inner.bias, res)
        if res is not None:                       # the bias-dropout-add passes out on (hooks.FusedBiasDropoutAdd)
            link.residual, link.added, link.out = None, res, out
        return out, None
