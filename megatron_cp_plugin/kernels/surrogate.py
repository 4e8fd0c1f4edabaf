"""The surrogate O of the backward (`surrogate_out`) in one Triton kernel.

BurstAttention and Attention2D circulate D = rowsum(dO * O) instead of O, and every fused backward (cuDNN,
FA2) takes O, not D: each travelling query block gets a surrogate O whose rowsum with dO is D (its
construction: `surrogate_out_reference`). In PyTorch that is about 25 ops per call (topk, abs, sign, scatter,
gather, sums, casts), each a pass over the block: on one H200, `scripts/profile_rank.py --seq-len 131072
--cp 16` (32 heads, d = 128, bf16, 8k rows per block) spends about 23 ms of a 90 ms rank backward in them,
18.5 ms of it in topk (15 calls). The construction is per row (the d entries of one (b, s, h)), so one kernel
does it with the row in registers: it reads dO (2 B/element) and D and writes O (2 B/element), about 134 MB
for such a block, some 30 us at the H200's bandwidth.

    out = surrogate_out(do [b, s, h, d], delta [b, h, s])     # -> [b, s, h, d] in do.dtype, contiguous
    surrogate_out_reference(do, delta)                        # the plain-PyTorch definition (any device, fp64)

The kernel runs on CUDA devices (CPU tensors under TRITON_INTERPRET=1 only with INTERPRET_CPU set) for fp16,
bf16 and fp32 with d <= MAX_D; fp64 and everything else take the reference. dO may be any strided view
(`do_j[:, qs]`), D any strided [b, h, s] view (`delta_j[:, :, qs]`, a transposed tensor): strides go to the
kernel, nothing is copied. A program takes tiles of `_default_rows` rows (d padded to a power of two, masked),
each row read as slices of SLICE_COLS columns held by a few threads; the three largest |dO| of a row are found by
three masked argmax passes over it (or, with select="keys", three max passes over packed integer keys, int32 for
16-bit dO and int64 for fp32: the same entries, the same output for finite dO).

The kernel does the reference's arithmetic in the reference's order, in fp32 (IEEE divisions, rounding to
nearest even; bf16 rounding on the bits, as Triton's interpreter truncates fp32 -> bf16 casts), except that
l1 = sum|dO| is summed in another order, a tie among the largest |dO| picks the leftmost entry (topk's pick is
unspecified) and the GPU may fuse a multiply-add. So it is the reference's construction but not its output bit
for bit: interpreted on 256 rows of d = 128, 99.9 % of bf16 and fp16 entries are equal (the others: rows with
tied top |dO| in bf16, an l1 one ulp apart in fp16), 40-60 % in fp32 (there c = D / l1 is not rounded to a
coarser dtype, so l1's last bit shows in every entry). tests/test_surrogate.py checks the property against the
reference's own error on the same rows, and c * sign(dO) off the top entries to a few ulps of the reference's.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU machines without triton: `available()` is False and surrogate_out uses the reference
    triton = tl = None

# One owner of the Triton-availability check (the flash-decoding kernel's).
from . import _launch  # noqa: E402
from .flash_decode import available  # noqa: E402,F401  (re-exported: surrogate.available)
from .math_attn import acc_dtype  # noqa: E402

INTERPRET_CPU = False
"""Run the kernel on CPU tensors too, through Triton's interpreter (TRITON_INTERPRET=1): tests/test_surrogate.py
sets it; elsewhere on CPUs the reference runs (interpreted, a call costs ~15 ms against 0.2 ms)."""
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_D = 256              # the row lives in registers: d up to 256 (the padded row of 256 fp32 per program row)
ELEMS_PER_PROGRAM = 2048  # rows per program: at least this / next_power_of_2(d) (16 at d = 128; `_default_rows`)
SELECTS = ("argmax", "keys")
SELECT = "keys"
"""How the kernel finds a row's three largest |dO| (`surrogate_out_triton`'s select): "argmax" takes an argmax and
a sum a pass; "keys" packs |dO|, the column and the sign into one integer (int32 for 16-bit dO, whose fp32 values
end in 13 or 16 zero bits that are dropped; int64 for fp32) and takes one max a pass. The same entries, the same
output bit for bit (tests/test_surrogate.py, compiled on the GPU for every launch shape below)."""
NUM_WARPS = 4
PROGRAMS_PER_SM = 32
"""Warps a program, and programs launched an SM (0: a program a tile of rows, the grid the tiles; n > 0: n programs
an SM, each looping over tiles with the next tile's load in flight). Few programs an SM loop slower (4: 0.33-0.47 ms
at 524288 rows, twenty-ninth session): the loop hides a load's latency only where enough programs share the SM."""
SLICE_COLS = 64
"""Columns of a row's slice (`_surrogate_kernel`): at d = 128 a row is two slices of 64, each over 8 threads with 8
16-bit entries a thread, so 8 threads share a row's scalar work where 16 did with whole rows (SLICE_COLS = 128, the
layout before: about 61 instructions an entry, issue-bound at 65 % of issue slots with the ALU pipe 81 % busy and
DRAM at 27 % in `ncu` on one H200, thirtieth session; 49 an entry in two slices). With NUM_WARPS, ELEMS_PER_PROGRAM,
PROGRAMS_PER_SM and INDEX_BITS the fastest of `megatron-cp-bench surrogate --slice-cols 128 64 32 16 --num-warps 1 2
4 --rows-per-program 4 8 16 32 --programs-per-sm 8 32` on one H200 (thirtieth session,
docs/results/surrogate_slices_s30/), then interleaved five times in one process, 524288 rows (burst's round call at
128k over P = 64), d = 128, bf16: 0.199 ms (median; 1.26 TB/s) against 0.242 for the launch before (2 warps, 4 whole
rows a program, int64); 131072 rows 0.087 against 0.094; 65536 0.069 against 0.068. In burst's replayed rank 0 at
128k over P = 64 the surrogate's kernels took 1.23-1.31 ms a fwd+bwd against 1.56-1.62. 32-column slices (4 threads a
row, 32 entries a thread) take fewer instructions an entry (40) but 166-191 registers a thread, and ran 0.202-0.206
ms."""
INDEX_BITS = 32
"""Width of the kernel's row and offset arithmetic: 32 where every offset fits (`_offsets_fit_int32`; else 64), or 64.
A program computes each row's (b, s, h) by two divisions and a remainder, which in int64 cost several times their
int32 form: 0.235 against 0.242 ms at 524288 rows with the launch before (one H200, thirtieth session)."""
KEY_SHIFT = {torch.bfloat16: 16, torch.float16: 13}   # fp32 bits a 16-bit value leaves zero: 23 - its 7 or 10
INTERPRET_ELEMS = 1 << 18  # under the interpreter (CPU tensors): a program costs ~10 ms of numpy whatever its
                           # size, so 16k rows at d = 64 take 6.3 s in programs of 32 rows, 0.2 s in 4096


def surrogate_out_reference(do: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """A tensor `out` in do's dtype with rowsum(do * out) == delta, for query rows whose D is known but O is
    not: every backend's backward reads O only to form D = rowsum(dO * O) (fp32 sums of exact products).

    do [b, s, h, d]; delta [b, h, s] fp32 (fp64 for fp64). Build it once per query block and reuse it over
    that block's key blocks. Like a real O it has entries c * sign(dO) with c = D / sum|dO|, so it fits the
    dtype wherever a real O does (|D| <= max|O| * sum|dO|: fp16's 65504 is never exceeded, issue 15); the
    three largest |dO| entries instead carry the rest and the rounding residues of each other, which makes
    D exact to fp32 (fp64), not to the 16-bit dtype (as long as the mean |O| is below a third of its max).
    """
    acc, big = acc_dtype(do.dtype), torch.finfo(do.dtype).max
    x = do.to(acc)
    t = delta.transpose(1, 2).unsqueeze(-1).to(acc)                     # [b, s, h, 1]
    mag = x.abs()
    top, idx = mag.topk(min(3, x.shape[-1]), -1)
    l1 = mag.sum(-1, keepdim=True)
    c = (t / torch.where(l1 > 0, l1, 1.0)).clamp_(-big, big).to(do.dtype).to(acc)
    out = torch.sign(x).mul_(c)
    rest = t - c * (l1 - top.sum(-1, keepdim=True))                     # what the top entries must carry
    xs, vals = x.gather(-1, idx), []
    zero = xs == 0                                                      # (mask and divisors built once)
    xs_safe = torch.where(zero, 1.0, xs)
    for i in range(idx.shape[-1]):
        xi = xs[..., i:i + 1]
        val = (rest / xs_safe[..., i:i + 1]).clamp_(-big, big).to(do.dtype).to(acc)
        val.masked_fill_(zero[..., i:i + 1], 0.0)
        rest = rest - xi * val
        vals.append(val)
    return out.scatter_(-1, idx, torch.cat(vals, -1)).to(do.dtype)


if triton is not None:
    @triton.jit
    def _round(v, OUT_TY: tl.constexpr, BF16: tl.constexpr):
        """fp32 v (finite, within OUT_TY's range) rounded to nearest-even in OUT_TY, as fp32. bf16 by bits:
        Triton's interpreter truncates fp32 -> bf16 casts, and the GPU gives the same value either way."""
        if BF16:
            bits = v.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        else:
            return v.to(OUT_TY).to(tl.float32)

    @triton.jit
    def _row_max(v):
        """The largest entry of each row of v [BLOCK_R, slices, W] (a row: its slices, in registers, and W columns)."""
        return tl.max(tl.max(v, 1), 1)

    @triton.jit
    def _row_sum(v):
        return tl.sum(tl.sum(v, 1), 1)

    @triton.jit
    def _take_max(x, mag, cols):
        """The largest remaining |x| of each row: (its column, its signed value, mag with it taken out); a tie goes
        to the leftmost column."""
        m = _row_max(mag)
        j = tl.min(tl.min(tl.where(mag == m[:, None, None], cols, 1 << 30), 1), 1)
        hit = cols == j[:, None, None]
        return j, _row_sum(tl.where(hit, x, 0.0)), tl.where(hit, -1.0, mag)   # (one nonzero term per row)

    @triton.jit
    def _keys(x, ok, cols, SHIFT: tl.constexpr):
        """One integer per entry that orders as (|x|, leftmost column) and carries x: |x|'s fp32 bits (non-negative
        floats order as integers) without their SHIFT low bits, then 255 - column, then x's sign; -1 on padding
        (never the largest). SHIFT >= 0 (16-bit dO, whose fp32 values end in SHIFT zero bits): int32 keys of at most
        27 bits; SHIFT < 0 (fp32): int64 keys of 40."""
        if SHIFT >= 0:
            bits = tl.abs(x).to(tl.int32, bitcast=True) >> SHIFT
            key = (bits << 9) | ((255 - cols) << 1) | (x < 0).to(tl.int32)
        else:
            bits = tl.abs(x).to(tl.int32, bitcast=True).to(tl.int64)
            key = (bits << 9) | ((255 - cols).to(tl.int64) << 1) | (x < 0).to(tl.int64)
        return tl.where(ok, key, -1)

    @triton.jit
    def _take_max_key(key, SHIFT: tl.constexpr):
        """_take_max on `_keys`: one max reduction of one value a row gives the column and the signed value."""
        k = _row_max(key)
        bits = (k >> 9).to(tl.int32)
        if SHIFT > 0:
            bits = bits << SHIFT
        m = bits.to(tl.float32, bitcast=True)
        return (255 - ((k >> 1) & 255).to(tl.int32), tl.where((k & 1) == 1, -m, m),
                tl.where(key == k[:, None, None], -1, key))

    @triton.jit
    def _next_top(x, sel, cols, KEYS: tl.constexpr, SHIFT: tl.constexpr):
        if KEYS:
            return _take_max_key(sel, SHIFT)
        else:
            return _take_max(x, sel, cols)

    @triton.jit
    def _carry(out, rest, j, xj, cols, BIG: tl.constexpr, OUT_TY: tl.constexpr, BF16: tl.constexpr):
        """Top entry (j, xj) of each row carries rest / xj (clamped, rounded to OUT_TY; 0 where xj = 0):
        -> (out with it written, the residual left)."""
        val = tl.math.div_rn(rest, tl.where(xj == 0, 1.0, xj))
        val = tl.where(xj == 0, 0.0, _round(tl.minimum(tl.maximum(val, -BIG), BIG), OUT_TY, BF16))
        return tl.where(cols == j[:, None, None], val[:, None, None], out), rest - xj * val

    @triton.jit
    def _columns(BLOCK_D: tl.constexpr, W: tl.constexpr):
        """The column of each entry of a [1, BLOCK_D / W, W] row: slice i holds columns i * W ... i * W + W - 1."""
        return tl.arange(0, BLOCK_D // W)[None, :, None] * W + tl.arange(0, W)[None, None, :]

    @triton.jit
    def _load_rows(DO, DELTA, tile, R, S, H, s_db, s_ds, s_dh, s_dd, s_tb, s_th, s_ts,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, W: tl.constexpr,
                   I64: tl.constexpr):
        """Rows tile * BLOCK_R ... of R = b * s * h (row = (b, s, h) in out's order): (dO in fp32 as [BLOCK_R, BLOCK_D /
        W, W] (`_columns`), D, the rows, the entries' mask); a tile past the end loads nothing (every lane
        masked). I64: row and offset arithmetic in int64 (else int32: the launcher's choice where every offset
        fits)."""
        if I64:
            rows = tile.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        else:
            rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < R
        hi, si, bi = rows % H, (rows // H) % S, rows // (H * S)
        cols = _columns(BLOCK_D, W)
        ok = row_ok[:, None, None] & (cols < D)
        x = tl.load(DO + (bi * s_db + si * s_ds + hi * s_dh)[:, None, None] + cols * s_dd, mask=ok,
                    other=0.0).to(tl.float32)
        t = tl.load(DELTA + bi * s_tb + hi * s_th + si * s_ts, mask=row_ok, other=0.0).to(tl.float32)
        return x, t, rows, ok

    @triton.jit
    def _rows_out(x, t, ok, cols, OUT_TY: tl.constexpr, NTOP: tl.constexpr, BIG: tl.constexpr, BF16: tl.constexpr,
                  KEYS: tl.constexpr, SHIFT: tl.constexpr):
        """The surrogate O of rows x [BLOCK_R, BLOCK_D / W, W] (fp32) with D = t, as fp32 values of OUT_TY."""
        mag = tl.abs(x)
        l1 = _row_sum(mag)
        c = tl.math.div_rn(t, tl.where(l1 > 0, l1, 1.0))                     # IEEE division, as torch's
        c = _round(tl.minimum(tl.maximum(c, -BIG), BIG), OUT_TY, BF16)
        out = tl.where(x > 0, c[:, None, None], tl.where(x < 0, -c[:, None, None], 0.0))
        # The NTOP = min(3, d) largest |x| carry rest = D - c * (l1 - their |x|), each in turn.
        # (KEYS: the same entries found by one single-value max a pass instead of an argmax and a sum)
        if KEYS:
            sel = _keys(x, ok, cols, SHIFT)
        else:
            sel = tl.where(ok, mag, -1.0)                                  # padding is never a top entry
        j1, x1, sel = _next_top(x, sel, cols, KEYS, SHIFT)
        top = tl.abs(x1)
        if NTOP >= 2:
            j2, x2, sel = _next_top(x, sel, cols, KEYS, SHIFT)
            top = top + tl.abs(x2)
        if NTOP >= 3:
            j3, x3, sel = _next_top(x, sel, cols, KEYS, SHIFT)
            top = top + tl.abs(x3)
        rest = t - c * (l1 - top)
        out, rest = _carry(out, rest, j1, x1, cols, BIG, OUT_TY, BF16)
        if NTOP >= 2:
            out, rest = _carry(out, rest, j2, x2, cols, BIG, OUT_TY, BF16)
        if NTOP >= 3:
            out, rest = _carry(out, rest, j3, x3, cols, BIG, OUT_TY, BF16)
        return out

    @triton.jit
    def _surrogate_kernel(DO, DELTA, OUT, R, S, H, n_tiles,
                          s_db, s_ds, s_dh, s_dd, s_tb, s_th, s_ts,
                          D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, W: tl.constexpr,
                          NTOP: tl.constexpr, BIG: tl.constexpr, BF16: tl.constexpr, KEYS: tl.constexpr,
                          SHIFT: tl.constexpr, I64: tl.constexpr):
        # Program p takes tiles p, p + programs, ... of BLOCK_R rows (one, where the grid is a program a tile) and
        # loads the next tile's dO before it works on this one's, so that its load is in flight during the three
        # max passes (a program that loads only after its store waits out the load's latency each tile).
        # A row is BLOCK_D / W slices of W columns (`_columns`): a slice is spread over W / 8 threads (8 16-bit
        # entries a thread, one 16-byte load; W / 4 in fp32) and the slices stay in that thread's registers, so a
        # row's scalar work (the four IEEE divisions, the roundings, the index arithmetic, each reduction's shuffles)
        # is done by W / 8 threads instead of BLOCK_D / 8: each thread that holds a row repeats it. The tensors
        # are [rows, slices, W], rows before slices: the compiler lays threads along the most contiguous axis (W)
        # and then, the other two tied, along the lower-numbered one; [slices, rows, W] put the threads on the
        # slices.
        OUT_TY = OUT.dtype.element_ty
        pid, step = tl.program_id(0), tl.num_programs(0)
        cols = _columns(BLOCK_D, W)
        x_n, t_n, rows_n, ok_n = _load_rows(DO, DELTA, pid, R, S, H, s_db, s_ds, s_dh, s_dd, s_tb, s_th, s_ts,
                                            D, BLOCK_D, BLOCK_R, W, I64)
        for tile in range(pid, n_tiles, step):
            x, t, rows, ok = x_n, t_n, rows_n, ok_n
            x_n, t_n, rows_n, ok_n = _load_rows(DO, DELTA, tile + step, R, S, H, s_db, s_ds, s_dh, s_dd,
                                                s_tb, s_th, s_ts, D, BLOCK_D, BLOCK_R, W, I64)
            out = _rows_out(x, t, ok, cols, OUT_TY, NTOP, BIG, BF16, KEYS, SHIFT)
            tl.store(OUT + rows[:, None, None] * D + cols, out.to(OUT_TY), mask=ok)


def _default_rows(block_d: int, w: int, num_warps: int, element_size: int) -> int:
    """Rows a program on a GPU: ELEMS_PER_PROGRAM / block_d, and at least one row for each group of threads that
    holds a slice (w / (16 / element_size) threads: one 16-byte load each), so that no thread of the launch holds a
    copy of another's rows (2 warps with 4 rows of 64-column slices ran 1.3 ms where 8 rows ran 0.24)."""
    per_load = max(1, 16 // element_size)
    return max(1, ELEMS_PER_PROGRAM // block_d, num_warps * 32 * per_load // max(w, per_load))


def use_kernel(do: torch.Tensor) -> bool:
    """Whether surrogate_out runs the Triton kernel for `do`: Triton on a CUDA device (or under
    TRITON_INTERPRET=1), fp16 / bf16 / fp32, d <= MAX_D."""
    return ((do.device.type == "cuda" or INTERPRET_CPU) and available(do.device) and do.dtype in DTYPES
            and do.dim() == 4 and 0 < do.shape[-1] <= MAX_D)


def _offsets_fit_int32(*tensors) -> bool:
    """Whether each tensor's numel and largest element offset (sum of (size - 1) * stride) are below 2**31 - 2**20, so
    that int32 holds every row index the kernel forms (the prefetch's past the last tile too: at most a grid of tiles
    more, 2**17 rows at 32 programs of 4 rows on 1024 SMs) and every offset it dereferences (a masked lane's may wrap:
    it is never read)."""
    limit = 2**31 - 2**20
    return all(t.numel() < limit and sum((n - 1) * st for n, st in zip(t.shape, t.stride())) < limit
               for t in tensors)


def surrogate_out_triton(do: torch.Tensor, delta: torch.Tensor, *, rows_per_program: int | None = None,
                         select: str | None = None, num_warps: int | None = None,
                         programs_per_sm: int | None = None, index_bits: int | None = None,
                         slice_cols: int | None = None):
    """The kernel (use_kernel(do) must hold): same contract as surrogate_out_reference. rows_per_program (a
    power of two) overrides the default: `_default_rows` on GPUs, INTERPRET_ELEMS / padded d
    (at most the rows, padded) under the interpreter. select (default SELECT) finds the top entries: "argmax"
    (an argmax and a sum a pass) or "keys" (one max of packed integer keys a pass); the same entries, the same
    output bit for bit (finite dO). num_warps (default NUM_WARPS) is the launch's. programs_per_sm (default
    PROGRAMS_PER_SM): 0 launches a program a tile of rows; n > 0 at most n programs an SM (one "SM" under the
    interpreter), each looping over tiles with the next one's load in flight. index_bits (default INDEX_BITS): 32 for
    the row and offset arithmetic where every offset of do, delta and out fits in int32 (else 64 anyway), or 64.
    slice_cols (default SLICE_COLS, a power of two; at most the padded d is taken): a row is read as slices of that
    many columns, each spread over the threads of one 16-byte load each, the slices in registers (`_surrogate_kernel`).
    An explicit rows_per_program should give every thread of the launch a row (`_default_rows`)."""
    select = SELECT if select is None else select
    if select not in SELECTS:
        raise ValueError(f"surrogate_out: select must be one of {SELECTS}, got {select!r}")
    b, s, h, d = do.shape
    if tuple(delta.shape) != (b, h, s):
        raise ValueError(f"surrogate_out: delta [b, h, s] = {(b, h, s)} expected for do {tuple(do.shape)}, "
                         f"got {tuple(delta.shape)}")
    out = torch.empty((b, s, h, d), dtype=do.dtype, device=do.device)
    rows = b * s * h
    if rows == 0:
        return out
    block_d = triton.next_power_of_2(d)
    w = SLICE_COLS if slice_cols is None else slice_cols
    if w < 1 or w & (w - 1):
        raise ValueError(f"surrogate_out: slice_cols must be a power of two, got {w}")
    w = min(w, block_d)
    num_warps = NUM_WARPS if num_warps is None else num_warps
    if rows_per_program is None and do.device.type == "cuda":
        rows_per_program = _default_rows(block_d, w, num_warps, do.element_size())
    elif rows_per_program is None:
        rows_per_program = min(triton.next_power_of_2(rows), max(1, INTERPRET_ELEMS // block_d))
    block_r = rows_per_program
    n_tiles = triton.cdiv(rows, block_r)
    bits = INDEX_BITS if index_bits is None else index_bits
    if bits not in (32, 64):
        raise ValueError(f"surrogate_out: index_bits must be 32 or 64, got {bits}")
    pps = PROGRAMS_PER_SM if programs_per_sm is None else programs_per_sm
    if pps < 0:
        raise ValueError(f"surrogate_out: programs_per_sm must be >= 0, got {pps}")
    programs = n_tiles
    if pps:
        programs = min(n_tiles, pps * (_launch.sm_count(do.device) if do.device.type == "cuda" else 1))
    _launch.launch(_surrogate_kernel, (programs,),
        do, delta, out, rows, s, h, n_tiles, *do.stride(), *delta.stride(),
        D=d, BLOCK_D=block_d, BLOCK_R=block_r, W=w, NTOP=min(3, d), BIG=torch.finfo(do.dtype).max,
        BF16=do.dtype == torch.bfloat16, KEYS=select == "keys", SHIFT=KEY_SHIFT.get(do.dtype, -1),
        I64=bits == 64 or not _offsets_fit_int32(do, delta, out),
        num_warps=num_warps)
    return out


def surrogate_out(do: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """A tensor `out` [b, s, h, d] in do's dtype with rowsum(do * out) == delta to fp32 (fp64 for fp64): see
    surrogate_out_reference for the construction. do [b, s, h, d] (any view); delta [b, h, s] fp32 (fp64 for
    fp64; any view). The Triton kernel where use_kernel(do), else the reference."""
    if use_kernel(do):
        return surrogate_out_triton(do, delta)
    return surrogate_out_reference(do, delta)
