"""Training RoPE of q or k in one kernel for the forward and one for the backward: megatron-core's fused-RoPE slot
(`apply_rope_fusion`) where TransformerEngine, which normally fills it, is not installed.

Why: without TE megatron-core applies RoPE as about ten elementwise kernels per tensor per layer (cos, sin, casts,
rotate-half's chunk / neg / cat, two multiplies, an add, a cat with the pass-through dims) and as many again in
the backward, on q and k views of the fused QKV projection, whose strides make most of them non-vectorized. In a
GPT-3 2.7B step at 64k tokens over CP = 2 (2 x H200, ulysses, session 17 profile) those kernels took ~0.17 s of
the 4.70 s step; this kernel reads the input once and writes the output once.

    out = fused_rope(t [s, b, h, d], freqs [s, 1 or b, 1, r] fp32)          # autograd; megatron-core's signature

Non-interleaved rotate-half RoPE on the first r dims (megatron-core's `_apply_rotary_pos_emb_bshd` with
rotary_interleaved off and mscale 1), dims r.. passed through, with F = freqs, x1 = x[:r/2], x2 = x[r/2:r]:
    forward   o1 = x1 cos F1 - x2 sin F1,     o2 = x2 cos F2 + x1 sin F2
    backward  g1 = y1 cos F1 + y2 sin F2,     g2 = y2 cos F2 - y1 sin F1     (the transpose: y = dL/do)
computed in fp32 and rounded once to t's dtype (megatron-core's unfused path rounds cos, sin and each product to
bf16; TE's fused kernel computes in fp32 as this one does). cos F and sin F are computed by torch (accurate at
positions of 10^6 radians, where a GPU's fast sin is not), once per frequency table and reused by every layer
(`_trig`). `rope_reference` is the plain-PyTorch definition and the path without Triton.
"""
from __future__ import annotations

import weakref

import torch

from .flash_decode import available

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

_TRIG: list = [None, -1, None, None]   # [weakref to the freqs table, its version, cos, sin]: one table per step


def _trig(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos F, sin F) [s, b_f, r] fp32 (fp64 for fp64) of a frequency table, cached for the last table seen: every
    layer's q and k, forward and backward, pass the same table object (the model's rotary embedding caches it)."""
    ref, version, cos, sin = _TRIG
    if ref is not None and ref() is freqs and version == freqs._version:
        return cos, sin
    f = freqs.reshape(freqs.shape[0], freqs.shape[1], freqs.shape[-1])
    f = f.double() if f.dtype == torch.float64 else f.float()
    cos, sin = f.cos().contiguous(), f.sin().contiguous()
    _TRIG[:] = [weakref.ref(freqs), freqs._version, cos, sin]
    return cos, sin


def rope_reference(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False) -> torch.Tensor:
    """The definition (module docstring), t [s, b, h, d], cos, sin [s, 1 or b, r]: fp32 math (fp64 for fp64),
    rounded once to t's dtype; `backward` applies the transpose (the gradient of the forward)."""
    r, half = cos.shape[-1], cos.shape[-1] // 2
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    x = t.to(acc)
    c, s = cos[:, :, None, :].to(acc), sin[:, :, None, :].to(acc)
    x1, x2 = x[..., :half], x[..., half:r]
    if backward:
        o1 = x1 * c[..., :half] + x2 * s[..., half:]
        o2 = x2 * c[..., half:] - x1 * s[..., :half]
    else:
        o1 = x1 * c[..., :half] - x2 * s[..., :half]
        o2 = x2 * c[..., half:] + x1 * s[..., half:]
    return torch.cat([o1, o2, x[..., r:]], dim=-1).to(t.dtype)


if triton is not None:
    @triton.jit
    def _rope_kernel(X, COS, SIN, O, sxs, sxb, sxh, scs, scb, B, H, HALF, D,
                     BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, PASS: tl.constexpr,
                     BLOCK_PASS: tl.constexpr, BACKWARD: tl.constexpr):
        # Program (token row = s * B + b, block of heads): cos, sin of the row loaded once for all its heads.
        row, hb = tl.program_id(0).to(tl.int64), tl.program_id(1)
        si, bi = row // B, row % B
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_HALF)
        hm, dm = heads < H, dims < HALF
        m = hm[:, None] & dm[None, :]
        trig = si * scs + bi * scb
        c1 = tl.load(COS + trig + dims, mask=dm, other=1.0)[None, :]
        c2 = tl.load(COS + trig + HALF + dims, mask=dm, other=1.0)[None, :]
        s1 = tl.load(SIN + trig + dims, mask=dm, other=0.0)[None, :]
        s2 = tl.load(SIN + trig + HALF + dims, mask=dm, other=0.0)[None, :]
        base = X + si * sxs + bi * sxb + heads[:, None] * sxh           # [BLOCK_H, 1]: each head's row
        x1 = tl.load(base + dims[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + dims[None, :], mask=m, other=0.0).to(tl.float32)
        if BACKWARD:
            o1 = x1 * c1 + x2 * s2
            o2 = x2 * c2 - x1 * s1
        else:
            o1 = x1 * c1 - x2 * s1
            o2 = x2 * c2 + x1 * s2
        dst = O + (row * H + heads[:, None]) * D                        # the output: contiguous [s, b, h, d]
        tl.store(dst + dims[None, :], o1.to(O.dtype.element_ty), mask=m)
        tl.store(dst + HALF + dims[None, :], o2.to(O.dtype.element_ty), mask=m)
        if PASS:                                                          # dims r..d: copied as they are
            pd = 2 * HALF + tl.arange(0, BLOCK_PASS)[None, :]
            pm = hm[:, None] & (pd < D)
            tl.store(dst + pd, tl.load(base + pd, mask=pm), mask=pm)


def rope_apply(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False,
               backend: str | None = None) -> torch.Tensor:
    """rope_reference's result, contiguous: the Triton kernel on CUDA (backend "triton": Triton's CPU interpreter
    too), the reference elsewhere. t [s, b, h, d] with any strides and a contiguous last dim."""
    s, b, h, d = t.shape
    r = cos.shape[-1]
    if r % 2 or r > d or cos.shape != sin.shape or cos.shape[0] != s or cos.shape[1] not in (1, b):
        raise ValueError(f"fused_rope: freqs [s={s}, 1 or b={b}, 1, r] with an even r <= head_dim {d} expected, "
                         f"got cos, sin {tuple(cos.shape)}")
    use = backend == "triton" or (backend is None and t.device.type == "cuda")
    if not (use and available(t.device)) or t.dtype == torch.float64:
        if backend == "triton":
            raise ValueError("fused_rope: backend='triton' needs Triton on a CUDA device (or its interpreter) and "
                             "a 16- or 32-bit float tensor")
        return rope_reference(t, cos, sin, backward).contiguous()
    if t.stride(-1) != 1:
        t = t.contiguous()
    out = torch.empty((s, b, h, d), dtype=t.dtype, device=t.device)
    block_h = min(triton.next_power_of_2(h), 32)
    rest = d - r
    _rope_kernel[(s * b, triton.cdiv(h, block_h))](
        t, cos, sin, out, t.stride(0), t.stride(1), t.stride(2), cos.stride(0),
        cos.stride(1) if cos.shape[1] > 1 else 0, b, h, r // 2, d,
        BLOCK_H=block_h, BLOCK_HALF=triton.next_power_of_2(r // 2), PASS=rest > 0,
        BLOCK_PASS=triton.next_power_of_2(max(rest, 1)), BACKWARD=backward, num_warps=4)
    return out


class _FusedRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs, backend):
        cos, sin = _trig(freqs)
        ctx.save_for_backward(freqs)          # the model's cached table: saving it keeps nothing new alive
        ctx.backend = backend
        return rope_apply(t, cos, sin, backward=False, backend=backend)

    @staticmethod
    def backward(ctx, grad):
        (freqs,) = ctx.saved_tensors
        cos, sin = _trig(freqs)
        return rope_apply(grad, cos, sin, backward=True, backend=ctx.backend), None, None


def fused_rope(t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False,
               interleaved: bool = False, *, backend: str | None = None) -> torch.Tensor:
    """RoPE of t [s, b, h, d] by freqs [s, 1 or b, 1, r] (fp32, the rotary embedding's output), differentiable in
    t; the signature of TE's `fused_apply_rotary_pos_emb`, which megatron-core calls when apply_rope_fusion is on.
    Interleaved RoPE and TE's transposed output layout are not implemented (megatron/compat.py's installer sends
    interleaved calls to megatron-core's own path)."""
    if interleaved or transpose_output_memory:
        raise ValueError("fused_rope: interleaved RoPE and transpose_output_memory are not implemented (use "
                         "megatron-core's unfused RoPE: apply_rope_fusion off)")
    if t.dim() != 4 or freqs.dim() != 4 or freqs.shape[2] != 1:
        raise ValueError(f"fused_rope: t [s, b, h, d] and freqs [s, 1 or b, 1, r] expected, got {tuple(t.shape)}, "
                         f"{tuple(freqs.shape)}")
    return _FusedRope.apply(t, freqs, backend)
