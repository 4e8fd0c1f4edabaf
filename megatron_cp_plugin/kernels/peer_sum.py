"""The split MLPs' reduce over NVLink (inference/split_mlp.py): every rank sums every rank's fp32 partial of a
layer's output straight from the peers' memory, adds fc2's bias and the residual, and rounds once: one kernel
instead of an NCCL all-reduce followed by the adds.

Why: a decode step of the 8B shape with its MLPs split over CP = 2 ranks reduces a b x 4096 fp32 partial (16 kB at
batch 1) in each of its 32 layers. Measured (`megatron-cp-bench peer-sum`, 2 x H100, graphed, per call): this kernel
9.75 us at batch 1 and 9.9 at batch 8, NCCL's all-reduce followed by the adds 18.1 and 18.9.

Each rank's fc2 GEMV writes its partial [rows, n] fp32 into its own symmetric buffer (symmetric.py). Then program
i of this kernel, for the elements [i * BLOCK, (i + 1) * BLOCK) of the rows x n partial:
  1. ready: sets flag [0, i, rank] of every peer and waits for every peer's here (peer_merge._signal_and_wait):
     every partial is in place;
  2. sum: y = sum of the P partials in rank order 0 .. P-1 (the same order, so the same bits, on every rank),
     + bias[n], + residual, in fp32, rounded once to out's dtype;
  3. done: sets flag [1, i, rank] of every peer and waits for theirs: no rank's next GEMV overwrites its buffer
     while a peer still reads it. Skipped (done=False) where another kernel's ready round fences the buffer
     (symmetric.fence: the decode step alternating this with peer_merge).

    peer_sum(bufs, rows, n, out, bias=None, residual=None)   # bufs: symmetric.PeerBuffers; out [rows, n]
    peer_sum_reference(parts [P, rows * n], rows, n, bias, residual, dtype)   # the same in PyTorch

Under Triton's CPU interpreter (the tests) the programs run one after another, so a test sets every flag a peer
would before the call (as for peer_merge).
"""
from __future__ import annotations

import os

import torch

from . import _launch
from .peer_merge import SPIN_LIMIT

try:
    import triton
    import triton.language as tl

    from .peer_merge import _signal_and_wait
except ImportError:
    triton = tl = None


def peer_sum_reference(parts: torch.Tensor, rows: int, n: int, bias: torch.Tensor | None = None,
                       residual: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """parts [P, >= rows * n] (each rank's partial, row-major) -> [rows, n]: the partials summed in rank order in
    parts' dtype, + bias [n], + residual [rows, n], cast to `dtype` (parts' unless given): the definition."""
    acc = parts[0, :rows * n].clone()
    for p in range(1, parts.shape[0]):
        acc += parts[p, :rows * n]
    y = acc.view(rows, n)
    if bias is not None:
        y = y + bias.to(y.dtype)
    if residual is not None:
        y = y + residual.reshape(rows, n).to(y.dtype)
    return y.to(dtype or parts.dtype)


if triton is not None:
    @triton.jit
    def _peer_sum_kernel(DATA_PTRS, FLAG_PTRS, OUT, BIAS, RES, RANK, WORLD, NUMEL, N,
                         HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, PP: tl.constexpr, W: tl.constexpr,
                         NPROG: tl.constexpr, BLOCK: tl.constexpr, COMPILED: tl.constexpr, LIMIT: tl.constexpr,
                         PDL: tl.constexpr = False, DONE: tl.constexpr = True):
        if PDL:                                     # (_launch.pdl) the partials come from the GEMV before
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        pid = tl.program_id(0)
        # 1. ready: every rank's partial is in its buffer.
        _signal_and_wait(FLAG_PTRS, RANK, WORLD, pid, PP, W, COMPILED, LIMIT)
        # 2. The partials in rank order (the peers' read over NVLink, ordered after the acquire by the barrier).
        idx = pid * BLOCK + tl.arange(0, BLOCK)
        ok = idx < NUMEL
        acc = tl.zeros([BLOCK], tl.float32)
        for p in tl.static_range(PP):
            if p < WORLD:
                base = tl.load(DATA_PTRS + p).to(tl.pointer_type(tl.float32))
                acc += tl.load(base + idx, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(BIAS + idx % N, mask=ok, other=0.0).to(tl.float32)
        if HAS_RES:
            acc += tl.load(RES + idx, mask=ok, other=0.0).to(tl.float32)
        tl.store(OUT + idx, acc.to(OUT.dtype.element_ty), mask=ok)
        # 3. done: every peer has read this rank's elements (its loads fed the store above).
        if DONE:
            tl.debug_barrier()
            _signal_and_wait(FLAG_PTRS, RANK, WORLD, NPROG + pid, PP, W, COMPILED, LIMIT)


def block_elems(numel: int, programs: int) -> int:
    """Elements per program: at least 512 (2 kB of fp32 read from each peer by one 4-warp program) and as many as
    keep the programs within `programs` (their flags). Not tuned on a GPU."""
    return max(512, triton.next_power_of_2(-(-numel // programs)))


def peer_sum(bufs, rows: int, n: int, out: torch.Tensor, bias: torch.Tensor | None = None,
             residual: torch.Tensor | None = None, *, done: bool | None = None) -> torch.Tensor:
    """Sum every rank's fp32 partial in bufs.data[:rows * n] ([rows, n] row-major) into out [rows, n] (a float
    dtype, contiguous), + bias [n] and + residual [rows, n] (out's dtype, contiguous) where given, rounded once; on
    every rank, one kernel. Every rank of the group calls it with the same rows and n, in the same order as its
    other calls of the symmetric kernels on these buffers. done: make the done round (step 3); None: unless
    `bufs.fenced` (symmetric.fence)."""
    def bad(t, shape):
        return t is not None and (tuple(t.shape) != shape or t.dtype != out.dtype or not t.is_contiguous()
                                  or t.device != out.device)

    if bufs.data.numel() < rows * n or tuple(out.shape) != (rows, n) or not out.is_contiguous() \
            or not out.dtype.is_floating_point or bad(bias, (n,)) or bad(residual, (rows, n)):
        raise ValueError(f"peer_sum: a buffer of >= {rows * n} fp32, out [{rows}, {n}] contiguous of a float dtype, "
                         f"bias [{n}] and residual [{rows}, {n}] of out's dtype and device expected, got "
                         f"{bufs.data.numel()}, out {tuple(out.shape)} {out.dtype}, bias "
                         f"{None if bias is None else (tuple(bias.shape), bias.dtype)}, residual "
                         f"{None if residual is None else (tuple(residual.shape), residual.dtype)}")
    _, programs, width = bufs.flags.shape             # [2 phases, programs, peers]
    numel = rows * n
    block = block_elems(numel, programs)
    pdl = _launch.pdl(out.device)
    _launch.launch(_peer_sum_kernel, (triton.cdiv(numel, block),), bufs.data_ptrs, bufs.flag_ptrs, out,
                   out if bias is None else bias, out if residual is None else residual, bufs.rank, bufs.world,
                   numel, n, HAS_BIAS=bias is not None, HAS_RES=residual is not None, PP=width, W=width,
                   NPROG=programs, BLOCK=block, LIMIT=SPIN_LIMIT, COMPILED=os.environ.get("TRITON_INTERPRET") != "1",
                   PDL=pdl, DONE=not bufs.fenced if done is None else done, launch_pdl=pdl, num_warps=4)
    return out
