"""Tree decoding's exchange and merge in one kernel over NVLink (tree-attention.txt, Alg. 3 lines 3-6): every
rank reads the others' partial (o, lse) straight from their memory and merges them, instead of an NCCL all-gather
followed by a merge kernel.

Why: a graphed CP = 2 decode step of the 8B shape at 128k on 2 x H200 spent 243 us in 32 NCCL all-gathers of
~16 kB (~7.6 us each, the wait for the other rank included) and 45 us in the 32 merges after them (docs/decode.md);
FlashInfer fuses the same exchange and merge into one kernel (`decode_cp_a2a_lse_reduce`) for that reason.

Each rank's split-KV step writes its packed partial (o [R, D] fp32 rows, then lse [R]) into its own symmetric
buffer (symmetric.py). Then program i of this kernel, for rows [i * BLOCK_R, (i + 1) * BLOCK_R):
  1. ready: sets flag [0, i, rank] of every peer (release, system scope), then waits until every peer has set
     its flag [0, i, peer] here (acquire) and clears it: every partial is in place;
  2. merge (line 3-6): m = max lse, w_p = exp(lse_p - m), out = sum_p w_p o_p / sum_p w_p, reading the peers'
     rows over NVLink, and writes out (the caller's dtype) and lse = m + log(sum w);
  3. done: sets flag [1, i, rank] of every peer and waits for theirs: no rank's next split-KV step overwrites
     its buffer while a peer still reads it. The two phases make any sequence of calls safe (a CUDA graph of
     any number of layers, replayed), at one more NVLink round trip per call. Skipped (done=False) where another
     kernel's ready round fences the buffer (symmetric.fence: the decode step alternating this with peer_sum).
A wait that lasts more than SPIN_LIMIT polls (a peer that never comes: ranks that disagree on their calls)
traps, which ends the process with a CUDA error instead of hanging the GPU.

    peer_merge(bufs, rows, d, out, out_lse)     # bufs: symmetric.PeerBuffers; out [rows, d], out_lse [rows] fp32
    peer_merge_reference(parts, d)              # parts [P, rows * (d + 1)] fp32: the same merge in PyTorch

Under Triton's CPU interpreter (the tests) the programs run one after another, so a test sets every flag a
peer would before the call.
"""
from __future__ import annotations

import os

import torch

from . import _launch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

SPIN_LIMIT = 1 << 30
"""Polls of a flag before the kernel traps. A poll is one atomic on this GPU's memory (about 0.5-1 us), so this
is minutes: longer than a decode step by far, about NCCL's default 10-minute timeout (not measured)."""


def peer_merge_reference(parts: torch.Tensor, d: int):
    """parts [P, R * d + R] (each rank's packed o rows, then lse) -> (o [R, d], lse [R]) in parts' dtype: the
    merge of Alg. 3 lines 3-6 in PyTorch, the definition the kernel is tested against."""
    P, width = parts.shape
    R = width // (d + 1)
    o, lse = parts[:, :R * d].view(P, R, d), parts[:, R * d:]
    m = lse.max(0).values
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m)
    tot = w.sum(0)
    out = (o * w[..., None]).sum(0) / torch.where(tot > 0, tot, torch.ones_like(tot))[:, None]
    return out, torch.where(tot > 0, m + torch.log(tot), torch.full_like(tot, float("-inf")))


if triton is not None:
    @triton.jit
    def _signal_and_wait(FLAG_PTRS, RANK, WORLD, slot, PP: tl.constexpr, W: tl.constexpr,
                         COMPILED: tl.constexpr, LIMIT: tl.constexpr):
        """Set flag `slot` * W + RANK of every peer, then wait until every peer has set flag slot * W + peer
        here, clearing it (flags: int32, W per slot)."""
        peers = tl.arange(0, PP)
        others = (peers < WORLD) & (peers != RANK)
        bases = tl.load(FLAG_PTRS + peers, mask=peers < WORLD, other=0).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(bases + slot * W + RANK, 1, mask=others, sem="release", scope="sys")
        mine = tl.load(FLAG_PTRS + RANK).to(tl.pointer_type(tl.int32)) + slot * W + peers
        got = ~others
        n = 0
        while tl.sum(got.to(tl.int32), 0) < PP:
            old = tl.atomic_xchg(mine, 0, mask=~got, sem="acquire", scope="sys")
            got = got | (old == 1)
            n += 1
            if COMPILED:
                if n > LIMIT:
                    tl.inline_asm_elementwise("trap;", "=r,r", [n], dtype=tl.int32, is_pure=False, pack=1)
        tl.debug_barrier()                # every thread of the program past the wait before it reads or writes

    @triton.jit
    def _peer_merge_kernel(DATA_PTRS, FLAG_PTRS, OUT, LSE, RANK, WORLD, R,
                           PP: tl.constexpr, W: tl.constexpr, NPROG: tl.constexpr, BLOCK_R: tl.constexpr,
                           D: tl.constexpr, COMPILED: tl.constexpr, LIMIT: tl.constexpr,
                           PDL: tl.constexpr = False, DONE: tl.constexpr = True):
        if PDL:                                     # (_launch.pdl) the partials come from the kernel before
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        pid = tl.program_id(0)
        # 1. ready: every rank's partial is in its buffer.
        _signal_and_wait(FLAG_PTRS, RANK, WORLD, pid, PP, W, COMPILED, LIMIT)
        # 2. Lines 3-6, the peers' rows read over NVLink (ordered after the acquire by the barrier above).
        rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < R
        dims = tl.arange(0, D)
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        for p in tl.static_range(PP):
            if p < WORLD:
                base = tl.load(DATA_PTRS + p).to(tl.pointer_type(tl.float32))
                m = tl.maximum(m, tl.load(base + R * D + rows, mask=row_ok, other=float("-inf")))
        m_ref = tl.where(m == float("-inf"), 0.0, m)
        tot = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, D], tl.float32)
        for p in tl.static_range(PP):
            if p < WORLD:
                base = tl.load(DATA_PTRS + p).to(tl.pointer_type(tl.float32))
                w = tl.exp(tl.load(base + R * D + rows, mask=row_ok, other=float("-inf")) - m_ref)
                o = tl.load(base + rows[:, None] * D + dims[None, :], mask=row_ok[:, None], other=0.0)
                tot += w
                acc += o * w[:, None]
        out = acc / tl.where(tot > 0, tot, 1.0)[:, None]
        tl.store(OUT + rows[:, None] * D + dims[None, :], out.to(OUT.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE + rows, tl.where(tot > 0, m_ref + tl.log(tot), float("-inf")), mask=row_ok)
        # 3. done: every peer has read this rank's rows (its loads fed the stores above).
        if DONE:
            tl.debug_barrier()
            _signal_and_wait(FLAG_PTRS, RANK, WORLD, NPROG + pid, PP, W, COMPILED, LIMIT)


def block_rows(rows: int, programs: int) -> int:
    """Rows per program: at least 4 (one 4-warp program per 4 rows of d = 128 reads 2 kB from each peer), and as
    many as keep the programs within `programs` (their flags). Not tuned on a GPU."""
    return max(4, triton.next_power_of_2(-(-rows // programs)))


def peer_merge(bufs, rows: int, d: int, out: torch.Tensor, out_lse: torch.Tensor, *, done: bool | None = None):
    """Merge every rank's packed partial in bufs.data[:rows * (d + 1)] (o rows [rows, d] fp32, then lse [rows])
    into out [rows, d] (any float dtype, contiguous) and out_lse [rows] fp32, on every rank; one kernel. Every rank
    of the group calls it with the same rows, in the same order as its other calls of it. done: make the done round
    (step 3); None: unless `bufs.fenced` (symmetric.fence: another kernel's ready round orders these reads before
    any rank's next write of its buffer)."""
    if bufs.data.numel() < rows * (d + 1) or tuple(out.shape) != (rows, d) or not out.is_contiguous() \
            or tuple(out_lse.shape) != (rows,) or out_lse.dtype != torch.float32:
        raise ValueError(f"peer_merge: a buffer of >= {rows * (d + 1)} fp32, out [{rows}, {d}] contiguous and "
                         f"out_lse [{rows}] fp32 expected, got {bufs.data.numel()}, {tuple(out.shape)}, "
                         f"{tuple(out_lse.shape)} {out_lse.dtype}")
    _, programs, width = bufs.flags.shape             # [2 phases, programs, peers]
    br = block_rows(rows, programs)
    n = -(-rows // br)
    pdl = _launch.pdl(out.device)
    _launch.launch(_peer_merge_kernel, (n,), bufs.data_ptrs, bufs.flag_ptrs, out, out_lse, bufs.rank, bufs.world,
                   rows, PP=width, W=width, NPROG=programs, BLOCK_R=br, D=d, LIMIT=SPIN_LIMIT,
                   COMPILED=os.environ.get("TRITON_INTERPRET") != "1", PDL=pdl,
                   DONE=not bufs.fenced if done is None else done, launch_pdl=pdl, num_warps=4)
    return out, out_lse
