"""RoPE of a decoded token's q and k, and the append of its K, V to a fixed-capacity cache, in one kernel.

A decode step is launch-bound outside the weight and KV reads: Megatron's RoPE is about a dozen elementwise
kernels for q and another dozen for k in every layer (cos, sin, scale, casts, rotate-half, multiply-adds,
concatenations), and the cache append two more. Here one Triton program per (sequence, head) rotates its
q or k row in fp32 and stores it (q to its output, k into cache slot `slot`), or copies its v row into the
cache: one launch per layer. cos, sin of the step's position are computed once per step (accurately, by
torch) and shared by every layer.

    q_rot = rope_append(q [b, 1, h, d], k [b, 1, h_kv, d], v, cos [r/2], sin [r/2], slot [1], k_cache, v_cache)

Non-interleaved RoPE (Megatron's default) on the first r dims (r = d unless rotary_percent < 1):
    out[i]       = x[i] cos f_i - x[i + r/2] sin f_i,   out[i + r/2] = x[i + r/2] cos f_i + x[i] sin f_i.
`rope_append_reference` is the plain-PyTorch definition (and the CPU path).
"""
from __future__ import annotations

import torch

from . import _launch
from .flash_decode import HEAD_DIMS, available

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[0]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:2 * half]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, xf[..., 2 * half:]], dim=-1)
    return out.to(x.dtype)


def rope_append_reference(q, k, v, cos, sin, slot, k_cache, v_cache) -> torch.Tensor:
    """The definition: rotate q and k (fp32 math, rounded once), write k, v at cache slot `slot` [1]."""
    k_cache.index_copy_(1, slot, _rotate(k, cos, sin))
    v_cache.index_copy_(1, slot, v)
    return _rotate(q, cos, sin)


def _check(q, k, v, cos, sin, slot, k_cache, v_cache):
    b, n, h, d = q.shape
    if n != 1 or k.shape != v.shape or k.shape[:2] != (b, 1) or k.shape[3] != d:
        raise ValueError(f"rope_append: q [b, 1, h, d], k, v [b, 1, h_kv, d] expected, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.shape[0] != b or k_cache.shape[2:] != k.shape[2:]:
        raise ValueError(f"rope_append: caches [b, S, h_kv, d] matching k {tuple(k.shape)} expected, got "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if cos.shape != sin.shape or cos.dim() != 1 or 2 * cos.shape[0] > d:
        raise ValueError(f"rope_append: cos, sin [r / 2] with r <= head_dim {d} expected, got {tuple(cos.shape)}")
    if tuple(slot.shape) != (1,):
        raise ValueError(f"rope_append: slot must be [1], got {tuple(slot.shape)}")


if triton is not None:
    @triton.jit
    def _rope_append_kernel(Q, K, V, COS, SIN, SLOT, QO, KC, VC,
                            sqb, sqh, skb, skh, svb, svh, skcb, skct, skch, svcb, svct, svch,
                            H, H_KV, HALF, D: tl.constexpr, PDL: tl.constexpr = False):
        # Program (sequence, row): rows [0, H) rotate q, [H, H + H_KV) rotate k into the cache, the rest copy v.
        if PDL:                   # (_launch.pdl) q, k, v, cos, sin, the slot: all written by the kernels before
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        bi, j = tl.program_id(0).to(tl.int64), tl.program_id(1)     # cache offsets can pass 2^31
        dims = tl.arange(0, D)
        rot = dims < 2 * HALF
        first = dims < HALF
        partner = tl.where(first, dims + HALF, dims - HALF)
        f = tl.where(first, dims, dims - HALF)
        c = tl.load(COS + f, mask=rot, other=1.0)
        s = tl.load(SIN + f, mask=rot, other=0.0)
        s = tl.where(first, -s, s)
        slot = tl.load(SLOT)
        if j < H:
            src = Q + bi * sqb + j * sqh
            x = tl.load(src + dims).to(tl.float32)
            xp = tl.load(src + partner, mask=rot, other=0.0).to(tl.float32)
            dst = QO + (bi * H + j) * D
            tl.store(dst + dims, tl.where(rot, x * c + xp * s, x).to(QO.dtype.element_ty))
        elif j < H + H_KV:
            src = K + bi * skb + (j - H) * skh
            x = tl.load(src + dims).to(tl.float32)
            xp = tl.load(src + partner, mask=rot, other=0.0).to(tl.float32)
            dst = KC + bi * skcb + slot * skct + (j - H) * skch
            tl.store(dst + dims, tl.where(rot, x * c + xp * s, x).to(KC.dtype.element_ty))
        else:   # a name of its own: Triton merges same-named values of the branches and needs one dtype
            row = tl.load(V + bi * svb + (j - H - H_KV) * svh + dims)
            tl.store(VC + bi * svcb + slot * svct + (j - H - H_KV) * svch + dims, row)


def rope_append(q, k, v, cos, sin, slot, k_cache, v_cache, *, out=None, backend: str | None = None):
    """Rotated q [b, 1, h, d] (contiguous; `out` if given); k rotated and v written at cache slot `slot`.

    q, k, v: any strides with a contiguous last dim; cos, sin [r / 2] fp32 of the token's position; slot [1]
    int64 on the device; k_cache, v_cache [b, S, h_kv, d] with a contiguous last dim. backend None: Triton on
    CUDA devices, the reference elsewhere; "triton" forces the kernel (Triton's CPU interpreter in tests)."""
    _check(q, k, v, cos, sin, slot, k_cache, v_cache)
    b, _, h, d = q.shape
    h_kv = k.shape[2]
    use = backend == "triton" or (backend is None and q.device.type == "cuda")
    if not (use and available(q.device) and d in HEAD_DIMS):
        if backend == "triton":
            raise ValueError(f"rope_append: backend='triton' needs Triton and head_dim in {HEAD_DIMS}")
        o = rope_append_reference(q, k, v, cos, sin, slot, k_cache, v_cache)
        return o if out is None else out.copy_(o)
    if any(x.stride(-1) != 1 for x in (q, k, v, k_cache, v_cache)):
        raise ValueError("rope_append: q, k, v and the caches need a contiguous last (head_dim) dimension")
    out = torch.empty(b, 1, h, d, dtype=q.dtype, device=q.device) if out is None else out
    pdl = _launch.pdl(q.device)
    _rope_append_kernel[(b, h + 2 * h_kv)](
        q, k, v, cos, sin, slot, out, k_cache, v_cache,
        q.stride(0), q.stride(2), k.stride(0), k.stride(2), v.stride(0), v.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), h, h_kv, cos.shape[0], D=d, PDL=pdl, launch_pdl=pdl, num_warps=1)
    return out
