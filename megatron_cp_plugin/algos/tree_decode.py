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
  "allgather"   one all-gather of the packed (o, lse) of every rank, merged locally (`merge_`);
  "peer"        no collective: each rank's split-KV step writes its packed (o, lse) into symmetric memory and one
                kernel reads every peer's over NVLink and merges (kernels/peer_merge.py). One node, one GPU a
                rank, NCCL, CUDA tensors the split-KV kernel takes, and a `workspace` (which keeps the mapping).
Masks: `kv_positions` [b, s_local] gives each local key's global position (-1: an empty slot, which is how a
batch of different lengths is padded) and `q_positions` [b, n_q] each query's; a key is visible to a query iff
0 <= kv_pos <= q_pos, which also orders several query tokens causally among themselves (speculative
verification) once their own K, V are in the cache. Without positions every local key is visible.
A cache of fixed capacity (a CUDA-graphed generation step) passes `kv_lengths` [b] instead: keys [0, length)
of each row are the filled ones; the split-KV kernel reads nothing past them, so a step costs the fill.
With a `Workspace` (kernels/flash_decode.py) the local step writes its (o, lse) straight into the packed
all-gather buffer and allocates nothing, which is what a graph capture of all layers needs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import all_gather, resolve_group
from ..kernels import flash_decode as fd
from ..kernels.local_attn import decode_fwd
from ..kernels.merge import finite_lse, merge_
from ..kernels.peer_merge import peer_merge
from ..symmetric import peer_buffers

VARIANTS = ("allreduce3", "allreduce2", "allgather", "peer")
COLLECTIVE_VARIANTS = VARIANTS[:3]
"""The variants that run on any group (gloo, ranks sharing a GPU, CPU tensors) and merge any (o, lse)."""
DEFAULT_VARIANT = "allgather"    # fastest eager at 32k-512k on 2 x H200 (docs/results/decode.md): one collective + one fused merge kernel


def _check(q, k, v, group, variant, kv_positions, q_positions, validate, kv_lengths=None, workspace=None,
           backend=None):
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
    if kv_lengths is not None and (tuple(kv_lengths.shape) != (q.shape[0],) or kv_lengths.dtype.is_floating_point):
        raise ValueError(f"kv_lengths must be an integer tensor [b] = [{q.shape[0]}], got "
                         f"{tuple(kv_lengths.shape)} {kv_lengths.dtype}")
    group = resolve_group(group)
    if variant == "peer" and dist.get_world_size(group) > 1 and (
            workspace is None or not _split_kv(q, backend, kv_lengths, workspace)):
        raise ValueError("variant 'peer' needs workspace= (a kernels.flash_decode.Workspace, which keeps the "
                         f"symmetric buffers), CUDA tensors of head_dim in {fd.HEAD_DIMS}, not fp64, and the split-KV "
                         f"kernel (backend None or 'triton'); got workspace="
                         f"{'given' if workspace is not None else None}, q {q.dtype} on {q.device}, head_dim "
                         f"{q.shape[-1]}, backend {backend!r}")
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
                kv_lengths: torch.Tensor | None = None, backend: str | None = None, validate: bool = True,
                workspace: fd.Workspace | None = None) -> torch.Tensor:
    """Decode-time attention over a KV cache sharded over `group` (no autograd).

    q [b, n_q, h, d] replicated on every rank; k, v [b, s_local, h_kv, d] this rank's cache shard.
    Returns [b, n_q, h, d] on every rank. kv_lengths [b] (on q's device): only keys [0, length) of the shard
    are filled. `validate=False` skips the shape agreement check (one tiny all-gather) and the empty-cache
    check (a device-to-host read), for a generation loop that has already validated its shapes and cache
    (and for a CUDA graph capture, which allows no host read).
    """
    group = _check(q, k, v, group, variant, kv_positions, q_positions, validate, kv_lengths, workspace, backend)
    with torch.no_grad():
        if _split_kv(q, backend, kv_lengths, workspace):
            o, lse = _tree_decode_split_kv(q, k, v, group, softmax_scale, variant, kv_positions, q_positions,
                                           kv_lengths, workspace)
        else:
            if kv_lengths is not None:                                   # the other kernels take a mask
                kv_positions = positions_within(kv_lengths, k.shape[1], kv_positions)
            # Line 2: the local partial, split-KV flash-decoding (kernels/flash_decode.py) on GPUs.
            o, lse = decode_fwd(q, k, v, scale=softmax_scale, kv_positions=kv_positions, q_positions=q_positions,
                                backend=backend)                         # [b, n_q, h, d], [b, h, n_q] fp32
            o, lse = tree_merge(o, lse, group=group, variant=variant)
    # The check reads a value back to the host (a stall per call): done with the validation only.
    if validate and torch.isinf(lse).any():
        raise ValueError("tree_decode: a query sees no key on any rank (the KV cache is empty everywhere, or "
                         "every key is masked for it)")
    return o.to(q.dtype)


def positions_within(kv_lengths, s: int, kv_positions=None):
    """kv_positions [b, s] that mark slots at or past each row's length empty (-1); filled slots keep
    `kv_positions` (or their slot index)."""
    slots = torch.arange(s, device=kv_lengths.device)
    pos = slots.expand(kv_lengths.shape[0], s) if kv_positions is None else kv_positions
    return torch.where(slots[None, :] < kv_lengths[:, None], pos, torch.full_like(pos, -1))


def _split_kv(q, backend, kv_lengths, workspace) -> bool:
    """Whether to call the split-KV kernel directly (for kv_lengths / a workspace): on a CUDA device for any
    float dtype but fp64 (fp32 runs it exactly), or when backend="triton" asks for it (the CPU interpreter)."""
    if (kv_lengths is None and workspace is None) or backend not in (None, "triton"):
        return False
    ok = fd.available(q.device) and q.shape[-1] in fd.HEAD_DIMS and q.dtype != torch.float64
    return ok and (q.device.type == "cuda" or backend == "triton")


def _tree_decode_split_kv(q, k, v, group, scale, variant, kv_positions, q_positions, kv_lengths, ws):
    """Line 2 with the split-KV kernel, then the merge. allgather: the kernel's merged rows and lse land in one
    packed buffer, which is all-gathered and merged by one kernel into q's dtype (4 launches per layer)."""
    b, n_q, h, d = q.shape
    kw = dict(scale=scale, kv_positions=kv_positions, q_positions=q_positions, kv_lengths=kv_lengths, workspace=ws)
    if dist.get_world_size(group) == 1:
        # Nothing to merge: the split-KV combine writes q's dtype, so tree_decode's cast is a no-op (one kernel of
        # ~1.1 us and its ~0.45 us gap fewer per layer of a graphed step, H100 2026-11-26).
        return fd.flash_decode(q, k, v, out_dtype=q.dtype, **kw)
    if variant not in ("allgather", "peer"):
        o, lse = fd.flash_decode(q, k, v, **kw)
        return tree_merge(o, lse, group=group, variant=variant)
    rows = b * n_q * h
    take = ws.take if ws is not None else (lambda _n, n, dt, dev: torch.empty(n, dtype=dt, device=dev))
    if variant == "peer":
        # The packed partial goes into this rank's symmetric buffer, where the peers read it (a collective
        # mapping on the first call, outside any graph capture; again only if the rows grow).
        bufs = ws.keep("tree_decode.peer", q.device, lambda: peer_buffers(group, rows * (d + 1), q.device),
                       fits=lambda bf: bf.data.numel() >= rows * (d + 1))
        packed = bufs.data[:rows * (d + 1)]
    else:
        packed = take("tree_decode.packed", rows * (d + 1), torch.float32, q.device)
    fd.flash_decode(q, k, v, out=(packed[:rows * d].view(rows, d), packed[rows * d:]), **kw)
    if variant == "peer":
        # A new output per call, as the other variants return (a graph takes it from its pool).
        o_rows = torch.empty(rows, d, dtype=q.dtype, device=q.device)
        l_rows = torch.empty(rows, dtype=torch.float32, device=q.device)
        peer_merge(bufs, rows, d, o_rows, l_rows)
    else:
        parts = all_gather(group, packed)                                # [P, rows * (d + 1)]
        o_rows, l_rows = fd.merge_packed(parts, d, out_dtype=q.dtype)
    # Kernel row order (batch, KV head, query token, head in group) back to [b, n_q, h, d] and [b, h, n_q].
    h_kv = k.shape[2]
    g = h // h_kv
    o = o_rows.view(b, h_kv, n_q, g, d).permute(0, 2, 1, 3, 4).reshape(b, n_q, h, d)
    lse = l_rows.view(b, h_kv, n_q, g).permute(0, 1, 3, 2).reshape(b, h, n_q)
    return o, lse


def tree_merge(o: torch.Tensor, lse: torch.Tensor, *, group=None, variant: str = DEFAULT_VARIANT):
    """Alg. 3 lines 3-6 alone: merge every rank's partial (o, lse) over `group`; returns the global (o, lse).

    o [b, n_q, h, d] fp32/fp64, lse [b, h, n_q] same dtype (-inf where a rank saw no key); any local
    kernel may have produced them (DeFT's tree kernel does, for a prefix sharded over the group).
    """
    group = resolve_group(group)
    if variant not in VARIANTS:
        raise ValueError(f"tree_merge: variant must be one of {VARIANTS}, got {variant!r}")
    if dist.get_world_size(group) == 1:
        return o, lse
    if variant not in _MERGE:
        raise ValueError(f"tree_merge: variant {variant!r} merges inside tree_decode only (its partials live in "
                         f"symmetric memory); here use one of {tuple(_MERGE)}")
    return _MERGE[variant](group, o, lse)


def _allreduce(group, o, lse, packed: bool):
    m = lse.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)              # line 3
    m = finite_lse(m)
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
    b, n_q, h, d = o.shape
    lse_rows = lse.transpose(1, 2)                                       # [b, n_q, h]: o's row order
    parts = all_gather(group, torch.cat([o.flatten(), lse_rows.flatten()]))   # [world, n_o + n_lse]
    if o.dtype == torch.float32 and fd.available(o.device) and d in fd.HEAD_DIMS:
        # One fused merge kernel reading the gathered buffer in place: the fewest launches per layer.
        out, acc = fd.merge_packed(parts, d)
        return out.view(b, n_q, h, d), acc.view(b, n_q, h).transpose(1, 2)
    out, acc = torch.zeros_like(o), torch.full_like(lse, float("-inf"))
    n = o.numel()
    for r in range(parts.shape[0]):
        merge_(out, acc, parts[r, :n].view_as(o), parts[r, n:].view_as(lse_rows).transpose(1, 2))
    return out, acc


_MERGE = {"allreduce3": lambda g, o, l: _allreduce(g, o, l, packed=False),
          "allreduce2": lambda g, o, l: _allreduce(g, o, l, packed=True),
          "allgather": _allgather}
