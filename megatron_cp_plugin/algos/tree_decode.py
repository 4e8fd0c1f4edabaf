"""Tree decoding (tree-attention.txt, Alg. 3): attention of a few new query tokens over a KV cache sharded
along the sequence, with one small collective merge instead of moving the cache.

Every rank holds the same queries q [b, n_q, h, d] and its own slice of the cache k, v [b, s_local, h_kv, d]
(any length, zero included, and its own order). Alg. 3:
  line 2  local flash-decoding: the partial (o, lse) of the queries over the local keys;
  line 3  m = Allreduce(max, lse);
  line 4  n = o * exp(lse - m), d = exp(lse - m);
  line 5  n_g = Allreduce(sum, n), d_g = Allreduce(sum, d);
  line 6  out = n_g / d_g.
Variants (`variant=`), the same result:
  "allreduce3"  the paper's three all-reduces;
  "allreduce2"  max, then n and d packed into one sum all-reduce;
  "allgather"   one all-gather of the packed (o, lse) of every rank, merged locally (`merge_`).
Masks: `kv_positions` [b, s_local] gives each local key's global position (-1: an empty slot, which is how a
batch of different lengths is padded) and `q_positions` [b, n_q] each query's; a key is visible to a query iff
0 <= kv_pos <= q_pos, which also orders several query tokens causally among themselves (speculative
verification) once their own K, V are in the cache. Without positions every local key is visible.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import all_gather, resolve_group
from ..kernels import flash_decode as fd
from ..kernels.local_attn import decode_fwd
from ..kernels.merge import _finite, merge_

VARIANTS = ("allreduce3", "allreduce2", "allgather")
DEFAULT_VARIANT = "allgather"    # fastest eager at 32k-512k on 2 x H200 (docs/results/decode.md): one collective + one fused merge kernel


def _check(q, k, v, group, variant, kv_positions, q_positions, validate):
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [batch, seq, heads, head_dim]")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"k, v [b, s_local, h_kv, d] must match each other and q {tuple(q.shape)} in batch and "
                         f"head_dim, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"q heads ({q.shape[2]}) must be divisible by k, v heads ({k.shape[2]})")
    if k.dtype != q.dtype or v.dtype != q.dtype or k.device != q.device or v.device != q.device:
        raise ValueError("q, k, v must share one dtype and device")
    if kv_positions is not None and tuple(kv_positions.shape) != tuple(k.shape[:2]):
        raise ValueError(f"kv_positions must be [b, s_local] = {tuple(k.shape[:2])}, got {tuple(kv_positions.shape)}")
    if q_positions is not None and tuple(q_positions.shape) != tuple(q.shape[:2]):
        raise ValueError(f"q_positions must be [b, n_q] = {tuple(q.shape[:2])}, got {tuple(q_positions.shape)}")
    group = resolve_group(group)
    if validate and dist.get_world_size(group) > 1:
        # One tiny all-gather, so that ranks disagreeing on shapes raise together instead of hanging.
        dev = q.device if q.device.type == "cuda" else torch.device("cpu")
        meta = torch.tensor([*q.shape, k.shape[2], VARIANTS.index(variant), q_positions is not None], device=dev)
        metas = [torch.empty_like(meta) for _ in range(dist.get_world_size(group))]
        dist.all_gather(metas, meta, group=group)
        if any(not torch.equal(m, metas[0]) for m in metas):
            raise ValueError("q must be replicated: every rank of the group must pass the same q shape "
                             f"[b, n_q, h, d], k/v heads, variant and masking, got {[m.tolist() for m in metas]}")
    return group


def tree_decode(q, k, v, *, group=None, softmax_scale: float | None = None, variant: str = DEFAULT_VARIANT,
                kv_positions: torch.Tensor | None = None, q_positions: torch.Tensor | None = None,
                backend: str | None = None, validate: bool = True) -> torch.Tensor:
    """Decode-time attention over a KV cache sharded over `group` (no autograd).

    q [b, n_q, h, d] replicated on every rank; k, v [b, s_local, h_kv, d] this rank's cache shard.
    Returns [b, n_q, h, d] on every rank. `validate=False` skips the shape agreement check (one tiny
    all-gather) and the empty-cache check (a device-to-host read), for a generation loop that has already
    validated its shapes and cache.
    """
    group = _check(q, k, v, group, variant, kv_positions, q_positions, validate)
    with torch.no_grad():
        # Line 2: the local partial, split-KV flash-decoding (kernels/flash_decode.py) on GPUs.
        o, lse = decode_fwd(q, k, v, scale=softmax_scale, kv_positions=kv_positions, q_positions=q_positions,
                            backend=backend)                             # [b, n_q, h, d], [b, h, n_q] fp32
        o, lse = tree_merge(o, lse, group=group, variant=variant)
    # The check reads a value back to the host (a stall per call): done with the validation only.
    if validate and torch.isinf(lse).any():
        raise ValueError("tree_decode: a query sees no key on any rank (the KV cache is empty everywhere, or "
                         "every key is masked for it)")
    return o.to(q.dtype)


def tree_merge(o: torch.Tensor, lse: torch.Tensor, *, group=None, variant: str = DEFAULT_VARIANT):
    """Alg. 3 lines 3-6 alone: merge every rank's partial (o, lse) over `group`; returns the global (o, lse).

    o [b, n_q, h, d] fp32/fp64, lse [b, h, n_q] same dtype (-inf where a rank saw no key); any local
    kernel may have produced them (DeFT's tree kernel does, for a prefix sharded over the group).
    """
    group = resolve_group(group)
    if dist.get_world_size(group) == 1:
        return o, lse
    return _MERGE[variant](group, o, lse)


def _allreduce(group, o, lse, packed: bool):
    m = lse.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)              # line 3
    m = _finite(m)
    w = torch.exp(lse - m)                                             # line 4: d
    n = o * w.transpose(1, 2).unsqueeze(-1)                            #         n
    if packed:
        buf = torch.cat([n.flatten(), w.flatten()])
        dist.all_reduce(buf, group=group)
        n, w = buf[:n.numel()].view_as(n), buf[n.numel():].view_as(w)
    else:                                                              # line 5: the paper's two more
        dist.all_reduce(n, group=group)
        dist.all_reduce(w, group=group)
    out = n / torch.where(w > 0, w, torch.ones_like(w)).transpose(1, 2).unsqueeze(-1)   # line 6
    return out, m + torch.log(w)


def _allgather(group, o, lse):
    if o.dtype == torch.float32 and fd.available(o.device) and o.shape[-1] in fd.HEAD_DIMS:
        # One packed all-gather and one fused merge kernel: the fewest launches per layer (host-bound decode).
        b, n_q, h, d = o.shape
        lse_rows = lse.transpose(1, 2)                                   # [b, n_q, h]: o's row order
        parts = all_gather(group, torch.cat([o.flatten(), lse_rows.flatten()]))
        n = o.numel()
        out, acc = fd.merge_partials(parts[:, :n].view(-1, b * n_q * h, d), parts[:, n:])
        return out.view(b, n_q, h, d), acc.view(b, n_q, h).transpose(1, 2)
    parts = all_gather(group, torch.cat([o.flatten(), lse.flatten()]))   # [world, n_o + n_lse]
    out, acc = torch.zeros_like(o), torch.full_like(lse, float("-inf"))
    for r in range(parts.shape[0]):
        merge_(out, acc, parts[r, :o.numel()].view_as(o), parts[r, o.numel():].view_as(lse))
    return out, acc


_MERGE = {"allreduce3": lambda g, o, l: _allreduce(g, o, l, packed=False),
          "allreduce2": lambda g, o, l: _allreduce(g, o, l, packed=True),
          "allgather": _allgather}
