"""Split-KV flash-decoding (Triton): the local step of tree decoding (tree-attention.txt, Alg. 3 line 2)
and of the ring-decode baseline.

A decode step has a handful of query tokens and a long cache. A prefill kernel gives one program per
(batch, head, query block), so with b = 1 and 32 heads it runs 32 programs that each read 64k keys in
turn: on one H200 cuDNN reads a 64k-token, 8-KV-head shard in 140-150 us, about 1.8 TB/s of the 4.2
measured (docs/results/decode.md). Here the cache is cut into `num_splits` ranges that run as separate
programs (phase 1: a partial (o, lse) per range), then merged per query row (phase 2), as Flash-Decoding
does. Two more choices for decoding:
  * GQA folding: the g = h / h_kv query heads of one KV head, times n_q query tokens, are the rows of one
    tile, so each K, V block is read once per KV head, not once per query head;
  * masks from positions: `kv_positions` [b, s] (-1 = empty slot) and `q_positions` [b, n_q]; a key is
    visible iff 0 <= kv_pos <= q_pos. That covers padded / ragged shards, a preallocated cache read past its
    fill, and several causal query tokens (speculative verification) without a dense mask.
K, V may be any strided view whose last dim is contiguous (a slice of a preallocated cache).
For a cache of fixed capacity (a CUDA-graphed decode step), `kv_lengths` [b] (a device tensor) bounds the
keys each row reads: programs past a row's length read nothing, so a step costs the fill, not the capacity,
and the launch shapes stay those of the capacity. `workspace` (a `Workspace`) holds the partials between
calls, so a step of many layers allocates nothing (nor does its graph capture); `out` lets phase 2 write the
merged rows straight into a caller's buffer (tree decoding's packed all-gather buffer).

    o, lse = flash_decode(q [b, n_q, h, d], k [b, s, h_kv, d], v, scale=None, kv_positions=None, q_positions=None,
                          kv_lengths=None, workspace=None, out=None)
    # o [b, n_q, h, d] fp32, lse [b, h, n_q] fp32 (-inf, o = 0 where a query sees no key)
    out, lse = merge_packed(parts [P, R*d + R], d, out_dtype)   # P packed (o, lse) partials -> one (o, lse)

`flash_decode_reference` is the plain-PyTorch definition it is tested against.
"""
from __future__ import annotations

import math
import os

import torch

from . import _launch

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU machines without triton: `available()` is False and callers use the math kernel
    triton = tl = None

HEAD_DIMS = (64, 128, 256)
BLOCK_N = 64            # keys per inner iteration
TARGET_PROGRAMS = 264   # about two waves of 132 SMs: enough splits to read at full bandwidth at b = 1


def available(device: torch.device) -> bool:
    """Whether the Triton kernel can run here (a CUDA device, or Triton's CPU interpreter)."""
    return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def flash_decode_reference(q, k, v, *, scale=None, kv_positions=None, q_positions=None):
    """fp64-capable definition: softmax(q k^T * scale, visibility) v per query and head; shapes as flash_decode."""
    b, n_q, h, d = q.shape
    g = h // k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    kk, vv = (x.repeat_interleave(g, dim=2).transpose(1, 2).to(torch.float64 if q.dtype == torch.float64
                                                                   else torch.float32) for x in (k, v))
    qq = q.transpose(1, 2).to(kk.dtype)
    s = qq @ kk.transpose(-1, -2) * scale                                  # [b, h, n_q, s]
    kv = kv_positions if kv_positions is not None else torch.arange(k.shape[1], device=q.device).expand(b, -1)
    vis = (kv >= 0)[:, None, None, :]
    if q_positions is not None:
        vis = vis & (kv[:, None, None, :] <= q_positions[:, None, :, None])
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, -1)                                           # [b, h, n_q]
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    return (p @ vv).transpose(1, 2), lse


if triton is not None:
    # The online softmax of one tile of rows, shared by this kernel and DeFT's (kernels/deft.py).
    @triton.jit
    def online_softmax_step(m_i, l_i, acc, s, vb, PREC: tl.constexpr):
        """One key block: s [M, N] scores in the log2 domain (-inf = not visible), vb [N, D] values; returns
        the updated running max m_i [M], denominator l_i [M] and unnormalised output acc [M, D] (fp32)."""
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)            # rows with nothing visible yet
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb,
                                                                                input_precision=PREC)

    @triton.jit
    def softmax_finish(acc, m_i, l_i):
        """(o [M, D], lse [M] natural log) of the accumulated rows; a row that saw nothing: o = 0, lse = -inf."""
        seen = l_i > 0
        o = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        return o, lse

    @triton.jit
    def _partial_kernel(Q, K, V, KPOS, QPOS, KLEN, O, L,
                        sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, spb, sqpb,
                        H_KV, S, SPLIT_LEN, NUM_SPLITS, scale_log2,
                        NQ: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        D: tl.constexpr, HAS_KPOS: tl.constexpr, HAS_QPOS: tl.constexpr, HAS_KLEN: tl.constexpr,
                        PREC: tl.constexpr):
        # Phase 1: program (b * h_kv + kv head, split) -> partial (o, lse) of its NQ * G rows over its keys.
        pid_bh, split = tl.program_id(0), tl.program_id(1)
        bi, kh = pid_bh // H_KV, pid_bh % H_KV
        bi = bi.to(tl.int64)        # batch offsets of a large cache (b x capacity x h_kv x d) pass 2^31
        rows = tl.arange(0, BLOCK_M)                  # row = query token t * G + head-in-group j
        t, j = rows // G, rows % G
        row_ok = rows < NQ * G
        dims = tl.arange(0, D)
        q = tl.load(Q + bi * sqb + t[:, None] * sqt + (kh * G + j)[:, None] * sqh + dims[None, :],
                    mask=row_ok[:, None], other=0.0)
        if HAS_QPOS:
            qpos = tl.load(QPOS + bi * sqpb + t, mask=row_ok, other=-1)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        # SPLIT_LEN is a multiple of BLOCK_N, so a split's blocks end at its own end or at the row's length.
        s_row = S
        n_end = SPLIT_LEN
        if HAS_KLEN:         # a fixed-capacity cache: read only the filled keys (none in splits past the fill)
            s_row = tl.minimum(tl.load(KLEN + bi).to(tl.int32), S)
            n_end = tl.minimum(s_row - split * SPLIT_LEN, SPLIT_LEN)
        for n0 in range(0, n_end, BLOCK_N):
            cols = split * SPLIT_LEN + n0 + tl.arange(0, BLOCK_N)
            col_ok = cols < s_row
            kb = tl.load(K + bi * skb + cols[:, None] * skt + kh * skh + dims[None, :], mask=col_ok[:, None], other=0.0)
            vb = tl.load(V + bi * svb + cols[:, None] * svt + kh * svh + dims[None, :], mask=col_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(kb), input_precision=PREC) * scale_log2   # log2 domain
            vis = col_ok[None, :] & row_ok[:, None]
            if HAS_KPOS:
                kpos = tl.load(KPOS + bi * spb + cols, mask=col_ok, other=-1)
                vis = vis & (kpos[None, :] >= 0)
                if HAS_QPOS:
                    vis = vis & (kpos[None, :] <= qpos[:, None])
            elif HAS_QPOS:
                vis = vis & (cols[None, :] <= qpos[:, None])
            m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, tl.where(vis, s, float("-inf")), vb, PREC)
        o, lse = softmax_finish(acc, m_i, l_i)          # a split that saw nothing: o = 0, lse = -inf
        base = (pid_bh * NUM_SPLITS + split) * BLOCK_M
        tl.store(O + (base + rows)[:, None] * D + dims[None, :], o, mask=row_ok[:, None])
        tl.store(L + base + rows, lse, mask=row_ok)

    @triton.jit
    def _merge_kernel(O, L, OUT, LSE, NUM_PARTS, ROWS, O_PART, O_GROUP, L_PART, L_GROUP,
                      PARTS: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr = False):
        # Program (group, row) merges the NUM_PARTS partials of its row: partial i of row r of group g is the D
        # values at O + g * O_GROUP + i * O_PART + r * D and the lse at L + g * L_GROUP + i * L_PART + r
        # (element offsets). The merged row goes to OUT (stored in OUT's dtype) and its lse to LSE (fp32).
        if PDL:                                     # (_launch.pdl) everything it reads comes from before
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        grp, row = tl.program_id(0), tl.program_id(1)
        sp = tl.arange(0, PARTS)
        sp_ok = sp < NUM_PARTS
        dims = tl.arange(0, D)
        lse = tl.load(L + grp * L_GROUP + sp * L_PART + row, mask=sp_ok, other=float("-inf"))
        m = tl.max(lse, 0)
        m_ref = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp(lse - m_ref)
        o = tl.load(O + grp * O_GROUP + sp[:, None] * O_PART + row * D + dims[None, :], mask=sp_ok[:, None],
                    other=0.0)
        tot = tl.sum(w, 0)
        out = tl.sum(o * w[:, None], 0) / tl.where(tot > 0, tot, 1.0)
        tl.store(OUT + (grp * ROWS + row) * D + dims, out.to(OUT.dtype.element_ty))
        tl.store(LSE + grp * ROWS + row, tl.where(tot > 0, m_ref + tl.log(tot), float("-inf")))


def _merge(o, lse, groups, parts, rows, part_stride, group_stride, out=None, out_lse=None, out_dtype=torch.float32):
    """Merge partials laid out in rows of o [*, D] / lse [*] (strides in rows, see _merge_kernel)."""
    d = o.shape[-1]
    out = torch.empty(groups * rows, d, device=o.device, dtype=out_dtype) if out is None else out
    out_lse = torch.empty(groups * rows, device=o.device, dtype=torch.float32) if out_lse is None else out_lse
    pdl = _launch.pdl(o.device)
    _merge_kernel[(groups, rows)](o, lse, out, out_lse, parts, rows, part_stride * d, group_stride * d,
                                  part_stride, group_stride, PARTS=triton.next_power_of_2(parts), D=d, PDL=pdl,
                                  launch_pdl=pdl, num_warps=4)
    return out, out_lse


def merge_packed(parts, d: int, out_dtype=torch.float32, out=None, out_lse=None):
    """Merge P packed partials in one kernel: parts [P, R * d + R] fp32, each row p = (o [R, d] flattened, then
    lse [R]) as one rank packed it for an all-gather -> (o [R, d] in out_dtype, lse [R] fp32). `out`, `out_lse`:
    optional destinations (no allocation)."""
    if parts.dim() != 2 or parts.dtype != torch.float32 or d not in HEAD_DIMS or parts.shape[1] % (d + 1):
        raise ValueError(f"merge_packed: parts [P, R * (d + 1)] fp32 with d in {HEAD_DIMS} expected, got "
                         f"{tuple(parts.shape)} {parts.dtype}, d = {d}")
    parts = parts.contiguous()
    P, width = parts.shape
    R = width // (d + 1)
    out = torch.empty(R, d, device=parts.device, dtype=out_dtype) if out is None else out
    out_lse = torch.empty(R, device=parts.device, dtype=torch.float32) if out_lse is None else out_lse
    pdl = _launch.pdl(parts.device)
    _merge_kernel[(1, R)](parts, parts[0, R * d:], out, out_lse, P, R, width, 0, width, 0,
                          PARTS=triton.next_power_of_2(P), D=d, PDL=pdl, launch_pdl=pdl, num_warps=4)
    return out, out_lse


def merge_partials(o_parts, lse_parts):
    """One fused merge of P partials per row (the allgather variant of tree decoding, done in one kernel).

    o_parts [P, R, D] fp32 contiguous, lse_parts [P, R] fp32 -> (o [R, D], lse [R]); -inf rows stay finite.
    """
    if o_parts.dim() != 3 or tuple(lse_parts.shape) != tuple(o_parts.shape[:2]) or o_parts.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"merge_partials: o_parts [P, R, D in {HEAD_DIMS}] and lse_parts [P, R] expected, got "
                         f"{tuple(o_parts.shape)} and {tuple(lse_parts.shape)}")
    P, R, _ = o_parts.shape
    return _merge(o_parts.contiguous(), lse_parts.contiguous(), 1, P, R, R, 0)


def _check(q, k, v, kv_positions, q_positions):
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"flash_decode: q [b, n_q, h, d] and k, v [b, s, h_kv, d] of one shape expected, got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    b, n_q, h, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or h % k.shape[2]:
        raise ValueError(f"flash_decode: k, v {tuple(k.shape)} must match q {tuple(q.shape)} in batch and head_dim, "
                         "and k's heads must divide q's")
    if d not in HEAD_DIMS:
        raise ValueError(f"flash_decode: head_dim must be one of {HEAD_DIMS}, got {d}")
    if any(x.stride(-1) != 1 for x in (q, k, v)):
        raise ValueError("flash_decode: q, k, v need a contiguous last (head_dim) dimension")
    if kv_positions is not None and tuple(kv_positions.shape) != (b, k.shape[1]):
        raise ValueError(f"kv_positions must be [b, s] = {(b, k.shape[1])}, got {tuple(kv_positions.shape)}")
    if q_positions is not None and tuple(q_positions.shape) != (b, n_q):
        raise ValueError(f"q_positions must be [b, n_q] = {(b, n_q)}, got {tuple(q_positions.shape)}")


class Workspace:
    """Scratch buffers reused by every call of a decode step: its layers call the same kernels with the same
    shapes one after another (stream order keeps them apart), so one buffer per name serves them all and a CUDA
    graph capture of the step allocates nothing here. A buffer grows only outside a capture."""

    def __init__(self):
        self._kept: dict = {}

    def keep(self, name: str, device: torch.device, make, fits=lambda _obj: True):
        """The object kept under `name` (a buffer; tree decoding's symmetric buffers): the one made before, if it
        `fits`, else make(), which a CUDA graph capture does not allow (the step's warm-up makes everything)."""
        obj = self._kept.get(name)
        if obj is None or not fits(obj):
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"Workspace: {name!r} would be allocated during CUDA graph capture; run the "
                                   "step once outside the capture (a warm-up) first")
            obj = self._kept[name] = make()
        return obj

    def kept(self, name: str):
        """The object kept under `name`, or None."""
        return self._kept.get(name)

    def take(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer of at least `numel` elements of dtype on device (its first numel)."""
        buf = self.keep(name, device, lambda: torch.empty(numel, dtype=dtype, device=device),
                        fits=lambda b: b.numel() >= numel and b.dtype == dtype and b.device == device)
        return buf[:numel]


def _stages(d: int, elem: int) -> int:
    """Pipeline stages of the K, V loads that fit in ~160 kB of shared memory (3 for bf16; fewer for fp32 and
    d = 256, where Triton's default of 3 would not fit)."""
    return max(1, min(3, (160 << 10) // (2 * BLOCK_N * d * elem)))


def num_splits_for(b: int, h_kv: int, s: int) -> int:
    """Splits so that b * h_kv * splits is about TARGET_PROGRAMS, each split at least one key block."""
    return max(1, min(math.ceil(TARGET_PROGRAMS / max(1, b * h_kv)), math.ceil(s / BLOCK_N)))


def flash_decode(q, k, v, *, scale: float | None = None, kv_positions=None, q_positions=None,
                 num_splits: int | None = None, kv_lengths=None, workspace: Workspace | None = None, out=None,
                 out_dtype=torch.float32):
    """Partial attention of q [b, n_q, h, d] over k, v [b, s, h_kv, d]: (o [b, n_q, h, d] out_dtype (fp32 by
    default; q's dtype where o is the final output: the combine rounds once and no cast kernel follows),
    lse [b, h, n_q] fp32).

    kv_lengths [b] (int, on q's device): row i reads keys [0, kv_lengths[i]) only (with kv_positions, both
    apply). out = (o_rows [b * h_kv * n_q * g, d] fp32, lse_rows [same] fp32): where the merged rows go, in
    the kernel's row order (batch, KV head, query token, head in group); the returned (o, lse) are views of them.
    """
    _check(q, k, v, kv_positions, q_positions)
    b, n_q, h, d = q.shape
    s, h_kv = k.shape[1], k.shape[2]
    g = h // h_kv
    if kv_lengths is not None and (tuple(kv_lengths.shape) != (b,) or kv_lengths.dtype.is_floating_point
                                   or kv_lengths.device != q.device):
        raise ValueError(f"kv_lengths must be an integer tensor [b] = [{b}] on {q.device}, got "
                         f"{tuple(kv_lengths.shape)} {kv_lengths.dtype} on {kv_lengths.device}")
    scale = d ** -0.5 if scale is None else scale
    block_m = max(16, triton.next_power_of_2(n_q * g))      # tl.dot needs 16 rows; padded rows cost no bandwidth
    splits = num_splits or num_splits_for(b, h_kv, s)
    split_len = triton.cdiv(triton.cdiv(max(s, 1), splits), BLOCK_N) * BLOCK_N
    splits = triton.cdiv(max(s, 1), split_len)
    n_part = b * h_kv * splits * block_m
    if workspace is not None:
        part_o = workspace.take("flash_decode.o", n_part * d, torch.float32, q.device).view(n_part, d)
        part_l = workspace.take("flash_decode.lse", n_part, torch.float32, q.device)
    else:
        part_o = torch.empty(n_part, d, device=q.device, dtype=torch.float32)
        part_l = torch.empty(n_part, device=q.device, dtype=torch.float32)
    kpos = kv_positions.contiguous() if kv_positions is not None else part_l     # a dummy pointer when absent
    qpos = q_positions.contiguous() if q_positions is not None else part_l
    klen = kv_lengths if kv_lengths is not None else part_l
    # The split kernel launches without PDL (its merge after it with): launched early, its two programs per SM
    # measured slower. One H100, the 8B step graphed (2026-11-26): with PDL here 5.76 / 10.17 ms at 32k / 128k,
    # without it 5.67 / 9.76, no PDL anywhere 5.88 / 10.00. Likely the early programs are placed while the
    # kernels before still hold SMs, unevenly, and the kernel ends on its busiest SM.
    _partial_kernel[(b * h_kv, splits)](
        q, k, v, kpos, qpos, klen, part_o, part_l,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), kpos.stride(0), qpos.stride(0),
        h_kv, s, split_len, splits, scale * 1.4426950408889634,
        NQ=n_q, G=g, BLOCK_M=block_m, BLOCK_N=BLOCK_N, D=d,
        HAS_KPOS=kv_positions is not None, HAS_QPOS=q_positions is not None, HAS_KLEN=kv_lengths is not None,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4,   # fp32 exact; tf32 is moot for bf16
        num_stages=_stages(d, k.element_size()))
    # Phase 2: partial i of row r of (batch, KV head) x is row (x * splits + i) * block_m + r.
    rows = b * h_kv * n_q * g
    if out is not None and (out[0].shape != (rows, d) or out[1].shape != (rows,) or out[0].dtype != torch.float32
                            or out[1].dtype != torch.float32 or not out[0].is_contiguous()):
        raise ValueError(f"flash_decode: out must be (fp32 [{rows}, {d}] contiguous, fp32 [{rows}])")
    o_rows, l_rows = _merge(part_o, part_l, b * h_kv, splits, n_q * g, block_m, splits * block_m,
                            *(out if out is not None else (None, None)), out_dtype=out_dtype)
    # Rows are (t, j) per KV head: back to [b, n_q, h, d] and [b, h, n_q] (head = kv head * g + j).
    o = o_rows.view(b, h_kv, n_q, g, d).permute(0, 2, 1, 3, 4).reshape(b, n_q, h, d)
    lse = l_rows.view(b, h_kv, n_q, g).permute(0, 1, 3, 2).reshape(b, h, n_q)
    return o, lse
