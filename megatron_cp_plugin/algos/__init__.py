"""The context-parallel attention algorithms (one row each in registry.py) and the validated public entry point."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import CommStats, resolve_group
from ..cp_grid import CPGrid, get_grid
from ..kernels.local_attn import select_backend
from . import registry
from ._layout import algo_documents
from ._packing import Packing
from .registry import layout_of, names

ALGORITHMS = names()
"""What users train with (--context-parallel-algo, choose_algo): the built-in rows of algos/registry.py (rows
registered later are in `registry.names()`)."""
BASELINES = tuple(r.name for r in registry.rows(baselines=True) if r.baseline)
"""What benchmarks compare against: `ring-te`, the ring with TransformerEngine's p2p byte budget (algos/ring.py);
context_parallel_attention runs it too."""
__all__ = ["ALGORITHMS", "BASELINES", "context_parallel_attention", "layout_of"]


def _check_inputs(q, k, v, algo, group, softmax_scale, backend, cu_seqlens):
    """Every check that can fail, done locally before any communication so that no rank is left waiting.
    Returns (group or grid, Packing or None)."""
    row = registry.get(algo)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [batch, seq, heads, head_dim], got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    b, s, h, d = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (b, s, d):
        raise ValueError(f"k, v [batch, seq, heads_kv, head_dim] must match q {tuple(q.shape)} in batch, seq and "
                         f"head_dim, got {tuple(k.shape)}")
    if h % k.shape[2] != 0:
        raise ValueError(f"q heads ({h}) must be divisible by k, v heads ({k.shape[2]}) (grouped-query attention)")
    if softmax_scale is not None and not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be positive or None, got {softmax_scale}")
    grid = group if isinstance(group, CPGrid) else None
    group = resolve_group(group)
    world = dist.get_world_size(group)
    packing = None
    if cu_seqlens is not None:
        if b != 1:
            raise ValueError(f"cu_seqlens: packed sequences have batch 1 (documents are concatenated along seq), "
                             f"got q {tuple(q.shape)}")
        packing = Packing.of(algo_documents(cu_seqlens, algo=algo, world_size=world, total=world * s), world)
    elif (world * s) % row.divisor(world):
        raise ValueError(f"q: the local sequence length {s} does not shard evenly: the full sequence (P * s = "
                         f"{world * s}) must be divisible by {row.divisor(world)} for the {row.layout} layout of "
                         f"algo={algo!r}")
    select_backend(q.device, q.dtype, d, backend, packed=packing is not None)
    if row.grid:
        return grid or get_grid(group, row.grid_shape(world, h, k.shape[2])), packing
    return group, packing


def context_parallel_attention(q, k, v, *, algo: str, group=None, causal: bool = True,
                               softmax_scale: float | None = None, cu_seqlens=None, backend: str | None = None,
                               comm_stats: CommStats | None = None) -> torch.Tensor:
    """Exact attention over a sequence sharded across `group`, differentiable.

    q [b, s_local, h, d]; k, v [b, s_local, h_kv, d] (h % h_kv == 0): this rank's shard in the layout of
    `algo` (see `shard_sequence`). Returns [b, s_local, h, d]. `group` may be a `CPGrid` (Attention2D's grid
    over a group; the other algorithms use its group); for Attention2D a plain group gets `choose_grid`'s.
    `softmax_scale=None` means d ** -0.5. `cu_seqlens` (int32 [n_docs + 1], or a sequence of ints: the
    cumulative document boundaries of the whole packed sequence, the same on every rank; batch 1): packed
    documents, each sharded on its own (`shard_sequence(..., cu_seqlens=)`); attention never crosses a document
    boundary and `causal` applies inside each. Every length must be a multiple of `sharding.document_unit`
    (2P zigzag, P cyclic). A CUDA tensor costs one device sync per call: pass host ints to avoid it.
    `backend` picks the local kernel (kernels.local_attn.BACKENDS, default by device and dtype);
    `comm_stats` (a CommStats) accumulates the bytes this rank sends, forward and backward.
    """
    group, packing = _check_inputs(q, k, v, algo, group, softmax_scale, backend, cu_seqlens)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return registry.get(algo).run(q, k, v, group=group, causal=causal, softmax_scale=scale, backend=backend,
                        comm_stats=comm_stats, packing=packing)
