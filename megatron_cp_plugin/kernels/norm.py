"""RMSNorm and LayerNorm of a few rows in one kernel, for the decode step.

A graphed decode step reads each norm's input once (one token: a few KB), so its cost is launches, not bytes.
torch's nn.RMSNorm on a CUDA bf16 input is eight kernels (fp32 cast, pow, mean, + eps, rsqrt, two multiplies,
bf16 cast; profiled on one H100, torch 2.11, 2026-11-26: 195 of a 32-layer step's 1121 kernels, 0.29 ms of its
7.46 ms at 32k, plus a ~0.45 us gap after each kernel of the graph). Here one Triton program per row computes
in fp32 and rounds once, as torch's composite does:

    RMSNorm    y = x / sqrt(mean(x^2) + eps) * w
    LayerNorm  y = (x - mean(x)) / sqrt(var(x) + eps) * w + b        (var: biased, as torch's)

    y = fused_norm(x [..., n], weight [n], bias [n] | None, eps, rms=True)

`norm_reference` is the plain-PyTorch definition (and the path without Triton or off CUDA).
"""
from __future__ import annotations

import torch

from . import _launch
from .flash_decode import available

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

# One program holds a whole row in registers: up to 16k features (hidden 4096 of the 8B decode shape, 12288 of
# GPT-3 175B); wider rows take the reference.
MAX_FEATURES = 16384


def norm_reference(x: torch.Tensor, weight, bias, eps: float, *, rms: bool = True) -> torch.Tensor:
    """The definition: fp32 math over the last dimension, rounded once to x's dtype."""
    xf = x.float()
    if not rms:
        xf = xf - xf.mean(-1, keepdim=True)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


if triton is not None:
    @triton.jit
    def _norm_kernel(X, W, B, Y, sx, sy, N, eps, RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        # the weights depend on no earlier kernel: with PDL they load while that kernel ends
        w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32) if HAS_W else 1.0
        b = tl.load(B + cols, mask=m, other=0.0).to(tl.float32) if HAS_B else 0.0
        if PDL:
            tl.extra.cuda.gdc_wait()
        x = tl.load(X + row * sx + cols, mask=m, other=0.0).to(tl.float32)
        if not RMS:
            x = tl.where(m, x - tl.sum(x, 0) / N, 0.0)
        y = x * tl.rsqrt(tl.sum(x * x, 0) / N + eps)
        if HAS_W:
            y = y * w
        if HAS_B:
            y = y + b
        tl.store(Y + row * sy + cols, y.to(Y.dtype.element_ty), mask=m)


def fused_norm(x: torch.Tensor, weight=None, bias=None, eps: float = 1e-5, *, rms: bool = True,
               backend: str | None = None, pdl: bool | None = None) -> torch.Tensor:
    """Norm of x [..., n] over its last dimension (contiguous), weight, bias [n] or None; a new tensor of x's
    dtype. backend None: Triton on CUDA devices, the reference elsewhere; "triton" forces the kernel (Triton's
    CPU interpreter in tests). pdl: launch with programmatic dependent launch (None: where _launch.pdl says so)."""
    n = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (n,):
            raise ValueError(f"fused_norm: {name} must be [{n}] (x's last dimension), got {tuple(t.shape)}")
    use = backend == "triton" or (backend is None and x.device.type == "cuda")
    # fp64 (the shared-GPU tests' models) keeps the reference: the kernel computes in fp32
    fits = n <= MAX_FEATURES and x.stride(-1) == 1 and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    if not (use and available(x.device) and fits):
        if backend == "triton":
            raise ValueError(f"fused_norm: backend='triton' needs Triton, a contiguous last dimension, at most "
                             f"{MAX_FEATURES} features and bf16, fp16 or fp32, got {n} with stride {x.stride(-1)}, "
                             f"{x.dtype}")
        return norm_reference(x, weight, bias, eps, rms=rms)
    rows = x.reshape(-1, n)                                     # a view for the decode step's [1, b, n]
    pdl = _launch.pdl(x.device) if pdl is None else pdl
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    _norm_kernel[(rows.shape[0],)](rows, weight if weight is not None else rows, bias if bias is not None else rows,
                                   y, rows.stride(0), y.stride(0), n, eps, RMS=rms, HAS_W=weight is not None,
                                   HAS_B=bias is not None, BLOCK=triton.next_power_of_2(n), PDL=pdl,
                                   launch_pdl=pdl, num_warps=4 if n <= 4096 else 8)
    return y.view(x.shape)
