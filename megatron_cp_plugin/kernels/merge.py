"""The (o, lse) merge: the one place partial attention results are combined; and fp32 gradient accumulation.

A partial over a subset of keys is (o, lse): o normalised over that subset, lse its natural-log
log-sum-exp. Two partials merge exactly:
    lse = logaddexp(lse1, lse2),  o = o1 * exp(lse1 - lse) + o2 * exp(lse2 - lse).
Accumulate in fp32 (or fp64): bf16 accumulation across ring steps loses about 2^-9 per step.
A row that saw no key has lse = -inf and o = 0; the merge keeps it finite.

    merge_(o, lse, o_blk, lse_blk)     # in place: (o, lse) <- merge((o, lse), (o_blk, lse_blk))
    merge_reference_(...)              # the same in PyTorch: the definition the kernel is tested against
    merge_many_(o, lse, o_blks, lse_blks, first)   # m partials [m, b, s, h, d] at once (first: (o, lse) empty)
    accumulate_(acc, x, copy=False)    # in place: acc <- acc + x (copy=True: acc <- x), x cast to acc's dtype
    row_sum(blocks, shape, dtype)      # a new accumulator: the sum of row blocks, 0 on rows none covers

`merge_` is one Triton launch (`_merge_kernel`, 10 bytes per element of o: o read and written, a bf16 o_blk read)
where it can run; its PyTorch form `merge_reference_` is five elementwise kernels, six with o_blk's fp32 cast,
about 18 bytes per element (lerp 15 x 0.12 ms and the casts' copies 15 x 0.09 ms of one ring rank's 70 ms at
P = 16, 128k, one H100, `scripts/profile_rank.py`). Each program of the kernel owns whole rows (every d of a
(b, s, h) row) and writes their lse after their o: an earlier fused merge that split rows over programs matched
under the interpreter, which runs programs one after another, and compiled gave ~1 % of rows another row's weight.

`accumulate_` is a Triton kernel. Adding a bf16 block gradient into an fp32 accumulator slice with torch,
`acc[:, rows].add_(g)`, mixes dtypes and so runs torch's non-vectorised `unrolled_elementwise_kernel`
(CUDAFunctor_add<float>: 4.3 ms for 45 calls at P = 16 in one rank of ring attention replayed on an H200,
`python scripts/profile_rank.py --seq-len 131072 --cp 16`); the kernel is one vectorised pass, 10 bytes per
element (acc read and written, x read), 6 with copy=True. Below ACCUMULATE_MIN_NUMEL elements torch's add_ runs:
there a rank is bound by host time, and a Triton launch costs more of it. `megatron-cp-bench merge` times both.
acc and x: one shape (up to 4 dims), any strides (no copies), e.g. a row slice acc_full[:, rows] of
[b, s, h, d]. The kernel runs on CUDA tensors where Triton is installed (and on CPU tensors under
TRITON_INTERPRET=1 only where `INTERPRET_CPU` is set, as tests/test_merge.py does: the rest of the CPU suite
would run 4.4x slower interpreted); elsewhere, for other dtypes and for tensors that need autograd, torch's
`acc.add_(x)` / `acc.copy_(x)` run.
"""
from __future__ import annotations

import os

import torch

from . import _launch
from .flash_decode import available

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU machines without triton: the plain-PyTorch definitions run
    triton = tl = None

INTERPRET_CPU = False
"""Run the kernels on CPU tensors too, through Triton's interpreter (TRITON_INTERPRET=1): the kernel tests set it."""
ACCUMULATE_MIN_NUMEL = 1 << 24
"""accumulate_ launches its kernel from this many elements up, torch's add_ / copy_ below. Measured on an H200
machine (scripts/launch_cost.py, bench/merge.py): the Triton launch costs ~30 us of host time against add_'s 5.5,
and saves ~7 us of GPU time at 8M elements (17 against 24 us) and ~25 us at 33M: below ~16M elements (2k tokens a
rank at 32 heads, d = 128: P = 64 at 128k) a rank's blocks are bound by host time, so the cheaper launch wins."""
_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)       # x dtypes accumulate_ reads
_TILE = 4096                 # elements per program on a GPU (16 KiB of fp32 accumulator)
_TILE_INTERPRET = 1 << 16    # under the CPU interpreter each program costs Python time: fewer, larger ones


def finite_lse(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf replaced by 0, so that `x - lse` never forms -inf - (-inf)."""
    return torch.where(torch.isinf(lse), 0.0, lse)


def merge_(o: torch.Tensor, lse: torch.Tensor, o_blk: torch.Tensor, lse_blk: torch.Tensor) -> None:
    """In place: (o, lse) <- merge((o, lse), (o_blk, lse_blk)).

    o [b, s, h, d] fp32/fp64 accumulator (a view is fine); lse [b, h, s] same dtype family;
    o_blk [b, s, h, d] any float dtype; lse_blk [b, h, s] fp32. One Triton launch for an fp32 o where Triton
    runs (`_triton_ok`), else `merge_reference_`; the two agree to fp32 rounding (tests/test_merge.py).
    """
    if not (o_blk.dim() == 4 and lse_blk.dim() == 3 and _merge_fits(o, lse, o_blk, lse_blk)):
        merge_reference_(o, lse, o_blk, lse_blk)
        return
    _launch_rows(_merge_kernel, o, lse, o_blk, lse_blk)


def merge_reference_(o: torch.Tensor, lse: torch.Tensor, o_blk: torch.Tensor, lse_blk: torch.Tensor) -> None:
    """`merge_` in PyTorch, for any dtypes (fp64 included): the definition the Triton kernel is tested against.

    Five elementwise kernels (six with o_blk's cast), one read and write of o: the block's weight
    exp(lse_blk - lse_new) is sigmoid(lse_blk - lse), the old part's 1 minus it, so o moves toward o_blk by
    lerp. Rows where both are -inf (no key seen yet) give NaN there, zeroed: o stays 0, lse -inf.
    """
    lse_blk = lse_blk.to(lse.dtype)
    w = torch.sub(lse_blk, lse).sigmoid_().nan_to_num_(0.0)            # [b, h, s]
    torch.logaddexp(lse, lse_blk, out=lse)
    o.lerp_(o_blk.to(o.dtype), w.transpose(1, 2).unsqueeze(-1))


def merge_many_(o: torch.Tensor, lse: torch.Tensor, o_blks: torch.Tensor, lse_blks: torch.Tensor,
                first: bool = False) -> None:
    """In place: (o, lse) <- the merge of (o, lse) (left out with first=True: it holds nothing yet) and the m partials
    o_blks [m, b, s, h, d] (any float dtype), lse_blks [m, b, h, s] fp32 (views allowed): one Triton launch for an
    fp32 o where Triton runs (each program owns whole rows, as merge_'s), else `merge_many_reference_`. Rows that saw
    no key anywhere: o 0, lse -inf. Attention2D-O merges a Q block's partials over the K, V chunks of one batched
    kernel call with it (algos/attention2d_o.py)."""
    if not (o_blks.dim() == 5 and lse_blks.dim() == 4 and o_blks.shape[0] == lse_blks.shape[0]
            and _merge_fits(o, lse, o_blks, lse_blks)):
        merge_many_reference_(o, lse, o_blks, lse_blks, first)
        return
    _launch_rows(_merge_many_kernel, o, lse, o_blks, lse_blks, m=o_blks.shape[0], FIRST=first)


def _merge_fits(o, lse, blk, lse_blk) -> bool:
    """Whether the merge kernels take these: fp32 o [b, s, h, d] and lse [b, h, s] (writable views), the partials'
    trailing dims theirs (o's in fp16 / bf16 / fp32, lse's fp32), Triton able to run (`_triton_ok`)."""
    return (o.dim() == 4 and lse.dim() == 3 and o.dtype == lse.dtype == lse_blk.dtype == torch.float32
            and blk.dtype in _FLOAT[:3] and tuple(blk.shape[-4:]) == tuple(o.shape)
            and tuple(lse_blk.shape[-3:]) == tuple(lse.shape) == (o.shape[0], o.shape[2], o.shape[1])
            and o.shape[0] * o.shape[1] * o.shape[2] < 2**31 and _writable(o) and _writable(lse)
            and _triton_ok(o, lse, blk, lse_blk))


def _launch_rows(kernel, o, lse, blk, lse_blk, m=None, **const) -> None:
    """One launch of a merge kernel over o's (b, s, h) rows, whole rows a program (_tile's rows of d)."""
    b, s, h, d = o.shape
    rows = b * s * h
    if rows == 0 or d == 0:
        return
    block_d, block_r, warps = _tile(d)
    block_r = min(block_r, triton.next_power_of_2(rows))
    sizes = (s, h, d, rows) if m is None else (m, s, h, d, rows)
    _launch.launch(kernel, (triton.cdiv(rows, block_r),), o, lse, blk, lse_blk, *sizes, *o.stride(), *lse.stride(),
                   *blk.stride(), *lse_blk.stride(), BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps, **const)


def merge_many_reference_(o, lse, o_blks, lse_blks, first: bool = False) -> None:
    """`merge_many_` in PyTorch (any dtypes): lse' = logsumexp over the partials (and (o, lse) unless first), o' = the
    sum of each partial's o weighted by exp(its lse - lse'); the definition the kernel is tested against."""
    ls = lse_blks.to(lse.dtype) if first else torch.cat([lse.unsqueeze(0), lse_blks.to(lse.dtype)])
    os_ = o_blks.to(o.dtype) if first else torch.cat([o.unsqueeze(0), o_blks.to(o.dtype)])
    new = torch.logsumexp(ls, dim=0)                                       # -inf where every part is -inf
    w = torch.exp(ls - finite_lse(new)).transpose(2, 3).unsqueeze(-1)      # [m(+1), b, s, h, 1]; 0 on empty rows
    o.copy_((w * os_).sum(0))
    lse.copy_(new)


def _writable(t: torch.Tensor) -> bool:
    """No two elements of t share memory (an expanded tensor's stride 0): the kernels write each element once."""
    return all(st != 0 or n == 1 for n, st in zip(t.shape, t.stride()))


def _triton_ok(*ts: torch.Tensor) -> bool:
    """Whether the Triton kernels may run on these tensors: Triton runs on their (common) device, and autograd
    does not need to see the in-place update (the kernels are invisible to it)."""
    dev = ts[0].device
    return (triton is not None and (dev.type == "cuda" or INTERPRET_CPU) and available(dev)
            and all(t.device == dev for t in ts)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in ts)))


def _tile(d: int) -> tuple[int, int, int]:
    """(BLOCK_D, rows per program, num_warps) for rows of d elements (wider rows in 1024-wide blocks)."""
    block_d = min(triton.next_power_of_2(d), 1024)
    tile = _TILE_INTERPRET if os.environ.get("TRITON_INTERPRET") == "1" else _TILE
    return block_d, max(1, tile // block_d), 4


def accumulate_(acc: torch.Tensor, x: torch.Tensor, copy: bool = False) -> None:
    """In place: acc <- acc + x, or acc <- x with copy=True (a first contribution), x cast to acc's dtype.

    acc fp32 or fp64, x any float dtype of acc's shape (up to 4 dims; views of any strides, e.g. a row slice
    acc_full[:, rows] of [b, s, h, d]): one Triton launch where it can run, else `acc.add_(x)` / `acc.copy_(x)`.
    Bit-identical to those: the sum is formed in acc's dtype (fp64 if either is fp64) and rounded once.
    """
    if not (acc.numel() >= ACCUMULATE_MIN_NUMEL and acc.dtype in (torch.float32, torch.float64)
            and x.dtype in _FLOAT and x.shape == acc.shape
            and 1 <= acc.dim() <= 4 and acc.numel() // max(acc.shape[-1], 1) < 2**31 and _writable(acc)
            and _triton_ok(acc, x)):
        if copy:
            acc.copy_(x)
        else:
            acc.add_(x)
        return
    if acc.numel() == 0:
        return
    pad = 4 - acc.dim()
    shape = (1,) * pad + tuple(acc.shape)
    sa, sx = (0,) * pad + acc.stride(), (0,) * pad + x.stride()
    n0, n1, n2, d = shape
    block_d, block_r, warps = _tile(d)
    rows = n0 * n1 * n2
    block_r = min(block_r, triton.next_power_of_2(rows))
    d_blocks = triton.cdiv(d, block_d)
    _launch.launch(_accumulate_kernel, (triton.cdiv(rows, block_r) * d_blocks,),
        acc, x, n1, n2, d, rows, d_blocks, *sa, *sx, BLOCK_R=block_r, BLOCK_D=block_d, COPY=copy, num_warps=warps)


def row_sum(blocks, shape, dtype, device=None) -> torch.Tensor:
    """A new accumulator of `shape` in `dtype` holding the sum of row blocks [(rows, x)] (rows: a slice of dim 1 and
    x that slice's values, e.g. the query rows of a ring step's kernel calls), 0 on rows no block covers: each row
    is set by its first block (accumulate_ with copy=True: no zero-fill under a block, no add of zeros), later blocks
    add. Row slices must be equal or disjoint. One block over every row, already in `dtype` (the math kernel's fp32
    gradients): that block itself, as x.to(dtype) would return it."""
    if len(blocks) == 1 and blocks[0][0].indices(shape[1])[:2] == (0, shape[1]) and blocks[0][1].dtype == dtype:
        return blocks[0][1]
    acc = torch.empty(shape, dtype=dtype, device=device if device is not None else blocks[0][1].device)
    spans = []
    for rows, x in blocks:
        span = rows.indices(shape[1])[:2]
        if any(span != sp and max(span[0], sp[0]) < min(span[1], sp[1]) for sp in spans):
            raise ValueError(f"row_sum: row blocks must be equal or disjoint, got {span} beside {spans}")
        accumulate_(acc[:, rows], x, copy=span not in spans)
        spans.append(span)
    at = 0
    for lo, hi in sorted(set(spans)) + [(shape[1], shape[1])]:      # the rows between the blocks
        if lo > at:
            acc[:, at:lo].zero_()
        at = max(at, hi)
    return acc


if triton is not None:
    @triton.jit
    def _accumulate_kernel(A, X, N1, N2, D, ROWS, D_BLOCKS, sa0, sa1, sa2, sa3, sx0, sx1, sx2, sx3,
                           BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, COPY: tl.constexpr):
        # Program r block * D_BLOCKS + d block -> BLOCK_R rows (i0, i1, i2) x BLOCK_D of the last dim.
        pid = tl.program_id(0)
        rb, db = pid // D_BLOCKS, pid % D_BLOCKS
        rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < ROWS
        i01 = rows // N2
        i0, i1, i2 = (i01 // N1).to(tl.int64), (i01 % N1).to(tl.int64), (rows % N2).to(tl.int64)
        dims = db * BLOCK_D + tl.arange(0, BLOCK_D)
        m = row_ok[:, None] & (dims < D)[None, :]
        a_ptr = A + (i0 * sa0 + i1 * sa1 + i2 * sa2)[:, None] + dims[None, :] * sa3
        x = tl.load(X + (i0 * sx0 + i1 * sx1 + i2 * sx2)[:, None] + dims[None, :] * sx3, mask=m, other=0.0)
        if COPY:
            y = x
        else:                       # as torch's add_: the sum in the promoted dtype (fp64 if either is), rounded once
            y = tl.load(a_ptr, mask=m, other=0.0) + x
        tl.store(a_ptr, y.to(A.dtype.element_ty), mask=m)

    @triton.jit
    def _merge_kernel(O, L, OB, LB, S, H, D, ROWS, so0, so1, so2, so3, sl0, sl1, sl2, sb0, sb1, sb2, sb3,
                      sm0, sm1, sm2, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        # Program p -> rows p BLOCK_R .. of the (b, s, h) rows, h fastest, every d of each: the only program that
        # reads or writes those rows' lse, so it may write them at the end (a row split over programs would race).
        pid = tl.program_id(0)
        rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        ok = rows < ROWS
        ib, isq, ih = (rows // (S * H)).to(tl.int64), ((rows // H) % S).to(tl.int64), (rows % H).to(tl.int64)
        l_ptr = L + ib * sl0 + ih * sl1 + isq * sl2
        l = tl.load(l_ptr, mask=ok, other=0.0)
        lb = tl.load(LB + ib * sm0 + ih * sm1 + isq * sm2, mask=ok, other=0.0)
        # merge_reference_'s steps: w = sigmoid(lb - l), NaN (both -inf) -> 0; lse = logaddexp(l, lb) as torch
        # forms it (equal infinities stay); o = lerp(o, o_blk, w) with torch's two-sided formula.
        w = 1.0 / (1.0 + tl.exp(l - lb))
        w = tl.where(w == w, w, 0.0)
        same_inf = (l == lb) & (tl.abs(l) == float("inf"))
        lse = tl.where(same_inf, l, tl.maximum(l, lb) + tl.log(1.0 + tl.exp(-tl.abs(l - lb))))
        w2 = w[:, None]
        o_row = (ib * so0 + isq * so1 + ih * so2)[:, None]
        b_row = (ib * sb0 + isq * sb1 + ih * sb2)[:, None]
        for d0 in range(0, D, BLOCK_D):
            dims = d0 + tl.arange(0, BLOCK_D)
            m = ok[:, None] & (dims < D)[None, :]
            o_ptr = O + o_row + dims[None, :] * so3
            x = tl.load(o_ptr, mask=m, other=0.0)
            y = tl.load(OB + b_row + dims[None, :] * sb3, mask=m, other=0.0).to(x.dtype)
            diff = y - x
            tl.store(o_ptr, tl.where(w2 < 0.5, x + w2 * diff, y - diff * (1.0 - w2)), mask=m)
        tl.store(l_ptr, lse, mask=ok)

    @triton.jit
    def _merge_many_kernel(O, L, OB, LB, M, S, H, D, ROWS, so0, so1, so2, so3, sl0, sl1, sl2,
                           sb0, sb1, sb2, sb3, sb4, sm0, sm1, sm2, sm3,
                           FIRST: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        # Program p -> rows p BLOCK_R .. of the (b, s, h) rows, every d and every partial of each (merge_'s ownership).
        pid = tl.program_id(0)
        rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        ok = rows < ROWS
        ib, isq, ih = (rows // (S * H)).to(tl.int64), ((rows // H) % S).to(tl.int64), (rows % H).to(tl.int64)
        l_ptr = L + ib * sl0 + ih * sl1 + isq * sl2
        lb_row = ib * sm1 + ih * sm2 + isq * sm3
        # Pass 1 over the partials' lse: the row maximum mx and the sum of exp(l - mx); lse' = mx + log(sum).
        if FIRST:
            mx = tl.full((BLOCK_R,), float("-inf"), tl.float32)
        else:
            mx = tl.load(l_ptr, mask=ok, other=float("-inf"))
        for i in range(0, M):
            mx = tl.maximum(mx, tl.load(LB + i * sm0 + lb_row, mask=ok, other=float("-inf")))
        fin = tl.where(mx == float("-inf"), 0.0, mx)                  # rows no partial saw a key: weights 0
        if FIRST:
            tot = tl.zeros((BLOCK_R,), tl.float32)
        else:
            tot = tl.exp(tl.load(l_ptr, mask=ok, other=float("-inf")) - fin)
        for i in range(0, M):
            tot += tl.exp(tl.load(LB + i * sm0 + lb_row, mask=ok, other=float("-inf")) - fin)
        inv = tl.where(tot > 0, 1.0 / tot, 0.0)
        new = tl.where(tot > 0, fin + tl.log(tot), float("-inf"))
        o_row = (ib * so0 + isq * so1 + ih * so2)[:, None]
        b_row = (ib * sb1 + isq * sb2 + ih * sb3)[:, None]
        # Pass 2 per d block: o' = sum of the parts' o, each weighted exp(l - lse').
        for d0 in range(0, D, BLOCK_D):
            dims = d0 + tl.arange(0, BLOCK_D)
            msk = ok[:, None] & (dims < D)[None, :]
            o_ptr = O + o_row + dims[None, :] * so3
            if FIRST:
                acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
            else:
                w0 = tl.exp(tl.load(l_ptr, mask=ok, other=float("-inf")) - fin) * inv
                acc = tl.load(o_ptr, mask=msk, other=0.0) * w0[:, None]
            for i in range(0, M):
                wi = tl.exp(tl.load(LB + i * sm0 + lb_row, mask=ok, other=float("-inf")) - fin) * inv
                x = tl.load(OB + i * sb0 + b_row + dims[None, :] * sb4, mask=msk, other=0.0).to(tl.float32)
                acc += x * wi[:, None]
            tl.store(o_ptr, acc, mask=msk)
        tl.store(l_ptr, new, mask=ok)
