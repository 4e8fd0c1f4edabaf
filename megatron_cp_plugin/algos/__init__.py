"""The context-parallel attention algorithms, their sequence layouts, and the validated public entry point."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import CommStats, CPGrid, get_grid, resolve_group
from ..kernels.local_attn import select_backend
from .attention2d import attention2d_no
from .attention2d_o import attention2d_o
from .burst import burst_attention
from .ring import ring_attention

_IMPLS = {"ring": ring_attention, "burst": burst_attention, "attention2d-no": attention2d_no,
          "attention2d-o": attention2d_o}
_LAYOUTS = {"ring": "zigzag", "burst": "zigzag", "attention2d-no": "cyclic", "attention2d-o": "cyclic"}
ALGORITHMS = tuple(_IMPLS)


def layout_of(algo: str) -> str:
    """The sequence layout of `algo` ("zigzag" or "cyclic"); ValueError for an unknown algo."""
    if algo not in _LAYOUTS:
        raise ValueError(f"algo must be one of {ALGORITHMS}, got {algo!r}")
    return _LAYOUTS[algo]


def _check_inputs(q, k, v, algo, group, softmax_scale, backend):
    """Every check that can fail, done locally before any communication so that no rank is left waiting."""
    layout = layout_of(algo)
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
    if layout == "zigzag" and s % 2 != 0:
        raise ValueError(f"q: the local sequence length {s} must be even: the full sequence (P * s = {world * s}) "
                         f"must be divisible by 2P = {2 * world} for the zigzag layout of algo={algo!r}")
    select_backend(q.device, q.dtype, d, backend)
    if layout == "cyclic":
        return grid or get_grid(group, h=h, h_kv=k.shape[2])
    return group


def context_parallel_attention(q, k, v, *, algo: str, group=None, causal: bool = True,
                               softmax_scale: float | None = None, backend: str | None = None,
                               comm_stats: CommStats | None = None) -> torch.Tensor:
    """Exact attention over a sequence sharded across `group`, differentiable.

    q [b, s_local, h, d]; k, v [b, s_local, h_kv, d] (h % h_kv == 0): this rank's shard in the layout of
    `algo` (see `shard_sequence`). Returns [b, s_local, h, d]. `group` may be a `CPGrid` (Attention2D's grid
    over a group; the other algorithms use its group); for Attention2D a plain group gets `choose_grid`'s. `softmax_scale=None` means d ** -0.5;
    `backend` picks the local kernel (kernels.local_attn.BACKENDS, default by device and dtype);
    `comm_stats` (a CommStats) accumulates the bytes this rank sends, forward and backward.
    """
    group = _check_inputs(q, k, v, algo, group, softmax_scale, backend)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return _IMPLS[algo](q, k, v, group=group, causal=causal, softmax_scale=scale, backend=backend,
                        comm_stats=comm_stats)
