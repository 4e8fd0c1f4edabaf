"""The decode step's bias and residual adds in one kernel: megatron-core's bias-dropout-add in eval.

After the attention projection and after fc2, megatron-core's transformer layer adds the linear's bias and the
residual (`_bias_dropout_add_func`; dropout is the identity in eval): x + bias, then + residual, two kernels
of one token's hidden vector each. In a graphed decode step those are 4 of a layer's ~20 kernels at ~1.5 us each
plus a ~0.45 us gap after every kernel of the graph (one H100, the 8B decode shape, 2026-11-26: 192 bias and
residual add kernels per 32-layer step, 0.26 ms of its 6.72 ms at 32k; docs/decode.md). Here one
Triton program per block of elements does both, each add rounded to x's dtype as torch's two are, so the result
is torch's bit for bit:

    y = (x + bias) + residual        x, residual [..., n], bias [n]

    y = fused_bias_residual(x, bias, residual)     a new tensor (megatron-core adds in place only where no
                                                   operand requires grad; its decode step runs the bias-dropout-add
                                                   under enable_grad with parameters that do, so out of place)

The MLP's fc1 bias and GELU (megatron-core's MLP without bias_activation_fusion: `x + bias`, then F.gelu, two
more kernels a layer) likewise, the add rounded as torch's and GELU as torch's CUDA kernel computes it (fp32,
x * 0.5 * (1 + erf(x / sqrt 2)), rounded once):

    y = fused_bias_gelu(x, bias)                 gelu(x + bias), a new tensor

`bias_residual_reference` and `bias_gelu_reference` are the plain-PyTorch definitions (and the paths without
Triton or off CUDA).
"""
from __future__ import annotations

import torch

from .flash_decode import available

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

BLOCK = 1024
"""Elements per program: a decode token's hidden vector (4096) is 4 programs; a prefill chunk is many."""
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""What the kernels take (they compute in fp32); fp64 (the CPU and shared-GPU tests' models) takes the reference."""


def bias_residual_reference(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The definition: torch's two adds, each rounded to x's dtype (a new tensor)."""
    return (x + bias) + residual


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The definition: torch's add, then torch's exact (erf) GELU, each rounded to x's dtype (a new tensor)."""
    return torch.nn.functional.gelu(x + bias)


if triton is not None:
    @triton.jit
    def _bias_gelu_kernel(X, B, Y, N, H, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
        b = tl.load(B + offs % H, mask=m, other=0.0).to(tl.float32)
        t = (x + b).to(X.dtype.element_ty, fp_downcast_rounding="rtne").to(tl.float32)   # x + bias, rounded as torch
        y = t * 0.5 * (1.0 + tl.math.erf(t * 0.7071067811865476))                        # torch's GELU, in fp32
        tl.store(Y + offs, y.to(Y.dtype.element_ty, fp_downcast_rounding="rtne"), mask=m)

    @triton.jit
    def _bias_residual_kernel(X, B, R, Y, N, H, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
        b = tl.load(B + offs % H, mask=m, other=0.0).to(tl.float32)
        t = (x + b).to(X.dtype.element_ty, fp_downcast_rounding="rtne").to(tl.float32)   # x + bias, rounded as torch
        r = tl.load(R + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(Y + offs, (t + r).to(Y.dtype.element_ty, fp_downcast_rounding="rtne"), mask=m)  # + residual


def _kernel_runs(name: str, backend: str | None, x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether `name`'s kernel takes these operands: backend None on CUDA or "triton", Triton here, contiguous
    tensors of DTYPES; "triton" with operands it cannot take raises, anything else takes the reference."""
    use = backend == "triton" or (backend is None and x.device.type == "cuda")
    fits = x.dtype in DTYPES and all(t.is_contiguous() for t in (x, *others))
    if use and available(x.device) and fits:
        return True
    if backend == "triton":
        raise ValueError(f"{name}: backend='triton' needs Triton and contiguous tensors of one of {DTYPES}")
    return False


def fused_bias_residual(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, *,
                        backend: str | None = None) -> torch.Tensor:
    """(x + bias) + residual, x and residual [..., n] of one dtype and shape, bias [n] of x's dtype: a new tensor.
    backend None: Triton on CUDA devices, the reference elsewhere; "triton" forces the kernel (Triton's CPU
    interpreter in tests)."""
    n = x.shape[-1]
    if tuple(bias.shape) != (n,):
        raise ValueError(f"fused_bias_residual: bias must be [{n}] (x's last dimension), got {tuple(bias.shape)}")
    if residual.shape != x.shape or residual.dtype != x.dtype or bias.dtype != x.dtype:
        raise ValueError(f"fused_bias_residual: residual must be x's shape {tuple(x.shape)} and dtype {x.dtype}, "
                         f"bias x's dtype; got {tuple(residual.shape)} {residual.dtype}, bias {bias.dtype}")
    if not _kernel_runs("fused_bias_residual", backend, x, bias, residual):
        return bias_residual_reference(x, bias, residual)
    y = torch.empty_like(x)
    N = x.numel()
    _bias_residual_kernel[(triton.cdiv(N, BLOCK),)](x, bias, residual, y, N, n, BLOCK=BLOCK, num_warps=4)
    return y


def fused_bias_gelu(x: torch.Tensor, bias: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """gelu(x + bias), x [..., n], bias [n] of x's dtype: a new tensor. backend as fused_bias_residual's."""
    n = x.shape[-1]
    if tuple(bias.shape) != (n,) or bias.dtype != x.dtype:
        raise ValueError(f"fused_bias_gelu: bias must be [{n}] (x's last dimension) of x's dtype {x.dtype}, got "
                         f"{tuple(bias.shape)} {bias.dtype}")
    if not _kernel_runs("fused_bias_gelu", backend, x, bias):
        return bias_gelu_reference(x, bias)
    y = torch.empty_like(x)
    N = x.numel()
    _bias_gelu_kernel[(triton.cdiv(N, BLOCK),)](x, bias, y, N, n, BLOCK=BLOCK, num_warps=4)
    return y
