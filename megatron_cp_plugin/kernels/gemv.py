"""A decode step's linear layers: a few rows times a weight matrix, the bias (and GELU) in the same kernel.

At batch 1-8 a decode step's linear layers are matrix-vector products: each reads its whole weight once and does
two flops per byte, so its time is the weight's bytes over the memory bandwidth. cuBLAS picks split-K GEMM
kernels for them, plus a split-K reduce kernel where K is long, and megatron-core adds the bias and applies GELU in
further kernels. Profiled on one H100 (the 8B decode shape, 32 layers, graphed, 2026-11-26): the weights ran at
2.6 TB/s of the 3.0 TB/s a copy reaches (QKV 2.4, the attention projection 2.1 with its reduce, fc1 2.8, fc2 2.7),
and per layer five kernels beside the four GEMMs (QKV's bias add, two split-K reduces, fc1's bias + GELU) cost
~12 us with their ~0.45 us gaps. Here one kernel per linear: each program streams BLOCK_N rows of the weight
over all of K (no split, so no reduce kernel), multiplies them with the M <= MAX_ROWS input rows in fp32, adds the
bias, applies GELU where asked, and rounds once:

    y = gemv(x [..., K], weight [N, K], bias [N] | None, gelu=False)     x @ weight.T (+ bias) (-> GELU)
    y = gemv(x, weight, bias, residual=r [..., N])                        ... + r (the layer's residual stream)
    gemv(x, weight[:, a:b], out=partial_fp32)                             a column slice (rows strided), into a buffer

`gemv_reference` is the plain-PyTorch definition (fp32 accumulation, one rounding) and the path off CUDA, for
fp64, for more than MAX_ROWS rows or without Triton. The sums run in another order than cuBLAS's, so results
differ from F.linear's in the last bits (tests/test_gemv.py holds them to the definition); a decode step that
uses this kernel graphed uses it eagerly too, so graphed and eager tokens stay equal.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from . import _launch
from .flash_decode import available

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

MAX_ROWS = 16
"""Input rows the kernel takes (one tl.dot tile; batch 1 uses a row path without it); more go to the reference."""
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""What the kernel takes (it accumulates in fp32); fp64 (the CPU and shared-GPU tests' models) takes the reference."""


class Grouped(NamedTuple):
    """megatron-core's fused QKV output [groups x (q_width + 2 head_dim)] (per KV group: its query heads, its key,
    its value), written instead as [all queries | all keys | all values] (groups x q_width, then groups x head_dim
    twice), so that q, k and v are views and the query needs no copy into heads."""
    q_width: int
    head_dim: int
    groups: int

    def order(self, device=None) -> torch.Tensor:
        """dest: output feature i of the fused layout goes to position dest[i] of the grouped one."""
        gw = self.q_width + 2 * self.head_dim
        i = torch.arange(self.groups * gw, device=device)
        g, j = i // gw, i % gw
        q, h = self.q_width, self.head_dim
        return torch.where(j < q, g * q + j, torch.where(j < q + h, self.groups * q + g * h + j - q,
                                                         self.groups * (q + h) + g * h + j - q - h))


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   gelu: bool = False, residual: torch.Tensor | None = None, dtype: torch.dtype | None = None,
                   grouped: Grouped | None = None) -> torch.Tensor:
    """The definition: x @ weight.T in fp32 (fp64 for fp64 operands) (+ bias), exact GELU where asked (+ residual),
    rounded once to `dtype` (x's unless given); with grouped, the output features in Grouped's order."""
    acc = torch.float64 if torch.float64 in (x.dtype, dtype) else torch.float32
    y = x.to(acc) @ weight.to(acc).T
    if bias is not None:
        y = y + bias.to(acc)
    if gelu:
        y = torch.nn.functional.gelu(y)
    if residual is not None:
        y = y + residual.to(acc)
    if grouped is not None:
        y = torch.empty_like(y).index_copy_(-1, grouped.order(y.device), y)
    return y.to(x.dtype if dtype is None else dtype)


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def config(m: int, n: int, k: int, device: torch.device | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for m rows of an [n, k] weight on `device`, from one sweep of 36
    configurations per path per GPU model (`megatron-cp-bench gemv --sweep`; us per call against torch's matmul +
    bias (+ GELU), each graphed, weights not in L2). An H200 (more bandwidth, the same 132 SMs) wants more weight
    rows a program; other devices take the H100's choice.
    One H100 (2026-11-26):
      one row, 4 rows x 1024 a step (1024-4096 programs, the whole of K per program; the fastest or within 1 % for
      every shape), 8 warps for the wide fc1 (42.8 against 44.8 us with 4; torch 47.1), 4 for the rest (QKV 21.7
      against 22.9, the projection 14.6 against 18.9, fc2 43.6 against 47.0);
      2-16 rows, tl.dot tiles of 32 rows, 3 stages, BLOCK_K falling as n grows (QKV 20.9 against 24.7, the
      projection 14.8 against 20.4, fc1 43.2 against 50.5, fc2 42.6 against 48.7 us at 8 rows).
    One H200 (2026-11-26, docs/results/gemv_h200.md; the H100 choice -> this one, torch):
      one row, 8 rows x 1024 a step where k <= 4096 (QKV 18.09 -> 14.76 us with 8 warps, torch 16.8; the projection
      10.44 -> 10.29; fc1 32.56 -> 30.80), fc2 (k = 14336) as on the H100 (32.72);
      8 rows, tiles of 64 weight rows where n > 4096 and 4 stages below n = 8192 (QKV 18.15 -> 17.02, the projection
      15.15 -> 13.11, fc1 32.14 -> 31.47, fc2 36.23 -> 33.00; torch 18.7, 17.1, 35.9, 37.0); only 1 and 8 rows
      were swept: 2-16 rows share the 8-row choice."""
    h200 = (device is not None and device.type == "cuda"
            and "H200" in _device_name(device.index if device.index is not None else torch.cuda.current_device()))
    if h200:
        if m == 1:
            return (8, 1024, 8 if 4096 < n <= 8192 else 4, 4) if k <= 4096 else (4, 1024, 4, 4)
        return 64 if n > 4096 else 32, 128 if n > 8192 else 256, 4, 3 if n > 8192 else 4
    if m == 1:
        return 4, 1024, 8 if n > 8192 else 4, 4
    return 32, 512 if n <= 4096 else 256 if n <= 8192 else 128, 4, 3


if triton is not None:
    @triton.jit
    def _gemv_kernel(X, W, B, R, Y, M, N, K, sx, sw, sr, sy, QW, GW, HN, NG,
                     HAS_BIAS: tl.constexpr, GELU: tl.constexpr, HAS_RES: tl.constexpr, GROUPED: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                     PRECISION: tl.constexpr, PDL: tl.constexpr):
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = rn < N
        w_rows = W + rn.to(tl.int64)[:, None] * sw
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        # The first K block of the weight depends on no earlier kernel: with PDL it loads while that kernel ends.
        rk = tl.arange(0, BLOCK_K)
        km = rk < K
        w0 = tl.load(w_rows + rk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()                       # x, the bias and the residual are read after this
        if ROWS == 1:
            # one row: multiply-accumulate elementwise, one reduction over K at the end
            acc2 = w0.to(tl.float32) * tl.load(X + rk, mask=km, other=0.0).to(tl.float32)[None, :]
            for k0 in range(BLOCK_K, K, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                km = rk < K
                x = tl.load(X + rk, mask=km, other=0.0).to(tl.float32)
                w = tl.load(w_rows + rk[None, :], mask=nm[:, None] & km[None, :], other=0.0).to(tl.float32)
                acc2 += w * x[None, :]
            acc = tl.sum(acc2, 1)[None, :]                                       # [1, BLOCK_N]
            rm = tl.arange(0, 1)
        else:
            rm = tl.arange(0, ROWS)
            mm = rm < M
            x = tl.load(X + rm[:, None] * sx + rk[None, :], mask=mm[:, None] & km[None, :], other=0.0)
            if UPCAST:
                x, w0 = x.to(tl.float32), w0.to(tl.float32)
            acc = tl.dot(x, tl.trans(w0), input_precision=PRECISION)
            for k0 in range(BLOCK_K, K, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                km = rk < K
                x = tl.load(X + rm[:, None] * sx + rk[None, :], mask=mm[:, None] & km[None, :], other=0.0)
                w = tl.load(w_rows + rk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
                if UPCAST:
                    x, w = x.to(tl.float32), w.to(tl.float32)
                acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(B + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
        if GELU:
            acc = acc * 0.5 * (1.0 + tl.math.erf(acc * 0.7071067811865476))                   # exact GELU
        if HAS_RES:
            acc += tl.load(R + rm[:, None] * sr + rn[None, :], mask=(rm < M)[:, None] & nm[None, :],
                           other=0.0).to(tl.float32)
        dest = rn
        if GROUPED:
            # megatron-core's fused QKV rows are per KV group [q heads of the group, k, v] (GW = QW + 2 HN rows);
            # the output is [all q | all k | all v], so that q, k, v are views (hooks.GroupedQKV)
            g, j = rn // GW, rn % GW
            dest = tl.where(j < QW, g * QW + j, tl.where(j < QW + HN, NG * QW + g * HN + j - QW,
                                                         NG * (QW + HN) + g * HN + j - QW - HN))
        tl.store(Y + rm[:, None] * sy + dest[None, :], acc.to(Y.dtype.element_ty),
                 mask=(rm < M)[:, None] & nm[None, :])

    # Triton's CPU interpreter (3.6) returns garbage from tl.dot on bf16 operands (fp32 ones are right): there the
    # tile goes up to fp32 first, exactly (a bf16 product is exact in fp32). Compiled, bf16 and fp16 stay.
    _INTERPRETED = type(_gemv_kernel).__name__ == "InterpretedFunction"


def _rows_contiguous(weight: torch.Tensor) -> bool:
    """Each row of the [N, K] weight contiguous (a contiguous weight, or a slice of its columns: the MLP's fc2 split
    over ranks, inference/split_mlp.py)."""
    return weight.dim() == 2 and (weight.stride(1) == 1 or weight.shape[1] == 1) and weight.stride(0) >= weight.shape[1]


def takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether gemv runs its kernel on these operands: CUDA, Triton, one dtype of DTYPES, a weight whose rows are
    contiguous, at most MAX_ROWS rows of contiguous last dimension, nothing that needs a gradient (a residual and
    an out buffer are checked by gemv itself)."""
    return (x.device.type == "cuda" and available(x.device) and x.dtype in DTYPES and weight.dtype == x.dtype
            and _rows_contiguous(weight) and x.shape[-1] == weight.shape[1]
            and x.numel() // max(x.shape[-1], 1) <= MAX_ROWS and x.stride(-1) == 1
            and (bias is None or (bias.dtype == x.dtype and tuple(bias.shape) == (weight.shape[0],)
                                  and bias.is_contiguous()))
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad))))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, gelu: bool = False,
         residual: torch.Tensor | None = None, backend: str | None = None,
         block: tuple[int, int, int, int] | None = None, pdl: bool | None = None,
         out: torch.Tensor | None = None, grouped: Grouped | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) (-> exact GELU) (+ residual [..., N] of x's dtype): [..., N] of
    x's dtype, a new tensor; with `out` (a contiguous [..., N] of any dtype of DTYPES, e.g. an fp32 partial sum in
    a symmetric buffer) written there instead, rounded once to out's dtype. The weight's rows may be strided (a
    slice of its columns). backend None: the kernel where `takes` says so, the reference elsewhere; "triton"
    forces the kernel (Triton's CPU interpreter in tests) and raises where it cannot take the operands. block:
    (BLOCK_N, BLOCK_K, num_warps, num_stages) instead of config()'s (the benchmark's sweep). pdl: launch with
    programmatic dependent launch (None: for one row, where _launch.pdl says so). grouped: megatron-core's fused QKV
    output reordered (Grouped)."""
    K = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != K:
        raise ValueError(f"gemv: weight must be [N, {K}] (x's last dimension), got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"gemv: bias must be [{weight.shape[0]}] (weight's rows), got {tuple(bias.shape)}")
    out_shape = (*x.shape[:-1], weight.shape[0])
    if residual is not None and (tuple(residual.shape) != out_shape or residual.dtype != x.dtype):
        raise ValueError(f"gemv: residual must be {out_shape} of x's dtype {x.dtype}, got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    if out is not None and (tuple(out.shape) != out_shape or not out.is_contiguous() or out.dtype not in DTYPES
                            + (torch.float64,) or out.device != x.device):
        raise ValueError(f"gemv: out must be a contiguous {out_shape} on {x.device} of a dtype in {DTYPES} (or fp64), "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    if grouped is not None:
        if grouped.groups * (grouped.q_width + 2 * grouped.head_dim) != weight.shape[0]:
            raise ValueError(f"gemv: grouped {tuple(grouped)} (q_width, head_dim, groups) must cover the weight's "
                             f"{weight.shape[0]} rows: groups x (q_width + 2 head_dim)")
        if residual is not None:
            raise ValueError("gemv: grouped (the fused QKV) takes no residual")
    if backend == "triton":
        ok = (triton is not None and x.dtype in DTYPES and weight.dtype == x.dtype and _rows_contiguous(weight)
              and x.numel() // max(K, 1) <= MAX_ROWS and (bias is None or bias.dtype == x.dtype))
        if not ok:
            raise ValueError(f"gemv: backend='triton' needs Triton, one dtype of {DTYPES} for x, weight and bias, a "
                             f"weight of contiguous rows and at most {MAX_ROWS} rows")
    elif (not takes(x, weight, bias) or (residual is not None and residual.requires_grad and torch.is_grad_enabled())
          or (out is not None and out.dtype not in DTYPES)):
        y = gemv_reference(x, weight, bias, gelu=gelu, residual=residual, dtype=None if out is None else out.dtype,
                           grouped=grouped)
        return y if out is None else out.copy_(y)
    N = weight.shape[0]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    r2 = None if residual is None else residual.reshape(M, N)
    if r2 is not None and r2.stride(-1) != 1:
        r2 = r2.contiguous()
    y = torch.empty(M, N, device=x.device, dtype=x.dtype) if out is None else out.view(M, N)
    if M:
        bn, bk, warps, stages = block or config(M, N, K, x.device)
        rows = 1 if M == 1 else MAX_ROWS
        if pdl is None:
            # One row only: with PDL the graphed step at batch 8 was slower on one H200 (32k: 12.40 against 11.84 ms
            # with no PDL anywhere; batch 1 4.40 against 4.61), so the 2-16 row path launches as it did before.
            pdl = M == 1 and _launch.pdl(x.device)
        gq = grouped or Grouped(1, 1, 1)
        _gemv_kernel[(triton.cdiv(N, bn),)](x2, weight, weight if bias is None else bias, y if r2 is None else r2,
                                             y, M, N, K, x2.stride(0), weight.stride(0),
                                             0 if r2 is None else r2.stride(0),
                                             y.stride(0), gq.q_width, gq.q_width + 2 * gq.head_dim, gq.head_dim,
                                             gq.groups, HAS_BIAS=bias is not None, GELU=gelu,
                                             HAS_RES=r2 is not None, GROUPED=grouped is not None,
                                             ROWS=rows, BLOCK_N=bn, BLOCK_K=bk,
                                             UPCAST=_INTERPRETED and x.dtype != torch.float32,
                                             # fp32 operands: Triton's default is TF32 (1e-3 off on an H100)
                                             PRECISION="ieee" if x.dtype == torch.float32 else None, PDL=pdl,
                                             launch_pdl=pdl, num_warps=warps, num_stages=stages)
    return y.reshape(*x.shape[:-1], N) if out is None else out
