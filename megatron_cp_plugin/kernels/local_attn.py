"""Local block attention with fp32 lse: the one module that calls into kernel libraries.

    block_fwd(q, k, v, mask=..., scale=...)                 -> (o [b, sq, h, d] in q.dtype, lse [b, h, sq] fp32)
    block_bwd(do, q, k, v, o, lse, mask=..., scale=...)     -> (dq [b, sq, h, d], dk, dv [b, sk, h_kv, d])
    decode_fwd(q, k, v, kv_positions=..., q_positions=...)  -> decode-step partial (o, lse), fp32
    sdpa_over_cache(q, k, v, lengths)                        -> the single-GPU decode anchor: torch's SDPA

Packed blocks (b = 1): `cu_seqlens_q`, `cu_seqlens_k` (a `segments.Segments`, or int cu_seqlens) cut the rows
into segments (documents); query segment i attends to key segment i only and the mask applies inside each
pair. One varlen kernel call per block, never one per document: aten's `_flash_attention_forward/backward`
with cum_seq (FA2 in torch), flash-attn's `_flash_attn_varlen_*`, or the math kernel with a segment mask.
cuDNN's varlen entry point is not used (torch's own varlen attention leaves it off; it takes no GQA).
"causal_strict" runs as causal over q[1:] and every key where the backend's causal mask is aligned at the top left
(`TOP_LEFT`: cuDNN, the default on Hopper, and math, so the CPU tests run what those GPUs run), else over q[1:],
k[:-1]; packed, as causal over q[1:], k[:-1] with a 1 x 1 dummy segment between documents whose result is
discarded (`segments.strict_view`), for every backend.

q [b, sq, h, d]; k, v [b, sk, h_kv, d] with h % h_kv == 0 (GQA: K, V are never expanded, every backend
reads the grouped heads directly). `lse` in block_bwd is the *global* lse of the query rows, and `o` their
global output (or `delta` = rowsum(dO * o) in its place), so the backward of any block can be recomputed
after the forward's merge (FlashAttention-2's backward, applied per block).

One backward contract for every backend: the kernel is handed O and derives D = rowsum(dO * O) from it
itself (cuDNN and FA2 take no D). Where only D is known (a block of another rank's queries), the caller
hands a surrogate O (`surrogate_out`) whose rowsum with dO is D; the math kernel takes the same path, so
the CPU tests exercise the surrogate the GPUs depend on. A D formed from a 16-bit O carries O's rounding:
where dP - D cancels (large activations) that bounds dq, dk for every such backward, one device included
(docs/numerics.md).

Masks: "none"; "causal" (key j visible to query i iff j <= i, needs sq == sk); "causal_strict" (j < i,
needs sq == sk; row 0 sees no key: o = 0, lse = -inf, and its gradients are 0); in block_fwd only, a bool
tensor [b, sq, sk] (True = visible), run by the math kernel (decoding: ragged caches, speculative tokens).

Backends:
  "cudnn"       torch.ops.aten._scaled_dot_product_cudnn_attention(+_backward); 603-616 TFLOP/s fwd on
                H200 (docs/design.md), the default on Hopper.
  "flash"       torch.ops.aten._scaled_dot_product_flash_attention(+_backward): FA2 inside torch,
                315-337 TFLOP/s; the default on other GPUs.
  "flash_attn"  the flash-attn package when importable (FA2 API, version shims below).
  "math"        chunked PyTorch on any device and dtype (fp32 accumulation, fp64 for fp64); memory bounded
                by chunk_size x chunk_size scores per head. The CPU default; the reference for the others.
"""
from __future__ import annotations

import functools
import inspect
import warnings

import torch

from . import flash_decode as fd
from .merge import accumulate_, merge_
from .math_attn import empty_result, acc_dtype, attention_delta, math_bwd, math_fwd, math_segments  # noqa: F401
from .segments import Segments, index_tensor, nonempty, strict_view
from .surrogate import surrogate_out  # noqa: F401  (re-exported: the algorithms' one import of the kernels)

MASKS = ("none", "causal", "causal_strict")
NONDETERMINISTIC_BWD: frozenset = frozenset({"cudnn"})   # H100, cuDNN 9.19, torch 2.11: 3 runs differ
"""Backends whose backward differs from run to run on the same inputs even with torch's deterministic switch
on (tests/determinism_probe.py); the automatic choice skips them while the switch is on (--deterministic-mode)."""
BACKENDS = ("cudnn", "flash", "flash_attn", "math")
MATH_CHUNK = 512
TOP_LEFT: frozenset = frozenset({"cudnn", "math"})
"""Backends whose causal kernel, handed fewer queries than keys, aligns the mask at the top left (key j visible to
query row i iff j <= i; flash-attn aligns it at the bottom right). They run a "causal_strict" block (j < i) as
q[1:] over every key, where the others take q[1:] over k[:-1]: the keys keep the block's length, a multiple of the
kernel's tile where the shard's is. cuDNN's backward of one 64k x 64k strict block with 16 heads of 128 on one H200
(2026-11-28, docs/results/p2_profile_s27/strict_split_h200.txt): 80.8-81.5 ms against 83.0-83.1 with both sides
65535 long (Attention2D's rank 0 at P = 2 has one such block and is the slower rank); the forward and 8k blocks the
same either way. `megatron-cp-bench local-attn --seq 65536 --masks causal causal_strict` times it."""


# ----------------------------------------------------------------------------------------- selection
@functools.lru_cache(maxsize=None)
def _flash_attn_module():
    try:
        import flash_attn.flash_attn_interface as fai  # noqa: PLC0415 (optional extra)
    except Exception:  # ImportError, or a build that does not match this torch
        return None
    return fai


@functools.lru_cache(maxsize=None)
def unsupported(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                packed: bool = False) -> str | None:
    """Why `backend` cannot run this block (`packed`: with cu_seqlens), or None when it can. Cached: it runs
    for every block call with an explicit backend, and at 2k tokens a rank the block calls are bound by host
    time (scripts/launch_cost.py: 30-65 us of host time per cuDNN call on an H200 machine)."""
    if backend == "math":
        return None
    if packed and backend == "cudnn":
        return "has no varlen (packed, cu_seqlens) path here: use 'flash' or 'flash_attn'"
    if device.type != "cuda":
        return f"needs a CUDA tensor, got device {device}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"needs fp16 or bf16, got {dtype}"
    if head_dim % 8 != 0:
        return f"needs a head dim divisible by 8, got {head_dim}"
    if backend == "cudnn":
        if not torch.backends.cudnn.is_available():
            return "cuDNN is not available in this torch build"
        if head_dim > 128:
            return f"supports head dim <= 128 (forward and backward), got {head_dim}"
    elif head_dim > 256:
        return f"supports head dim <= 256, got {head_dim}"
    if backend == "flash_attn" and _flash_attn_module() is None:
        return "flash-attn is not importable (pip install 'megatron-cp-plugin[flash]')"
    return None


def select_backend(device: torch.device, dtype: torch.dtype, head_dim: int, backend: str | None = None, *,
                   packed: bool = False) -> str:
    """The backend to use: `backend` when given (ValueError if it cannot run this), else by device and dtype:
    cuDNN on Hopper and newer (fastest measured), flash-attn when importable, FA2-in-torch, then math.
    `packed` (cu_seqlens): the varlen entry points, flash-attn's or FA2-in-torch's, then math."""
    if backend is not None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
        why = unsupported(backend, device, dtype, head_dim, packed)
        if why:
            raise ValueError(f"backend={backend!r} cannot run this attention: it {why}")
        return backend
    name = _auto_backend(device, dtype, head_dim, packed, torch.are_deterministic_algorithms_enabled())
    if name == "math" and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        warnings.warn(f"no fused attention kernel for head dim {head_dim}: using the slow math kernel", stacklevel=3)
    return name


@functools.lru_cache(maxsize=None)
def _auto_backend(device: torch.device, dtype: torch.dtype, head_dim: int, packed: bool, deterministic: bool) -> str:
    """select_backend's automatic choice, once per (device, dtype, head dim, packed, deterministic switch): it
    runs for every block call, and at 2k tokens a rank (P = 64, 128k) those are launch-bound on the CPU."""
    order = ["math"]
    if device.type == "cuda":
        hopper = torch.cuda.get_device_capability(device)[0] >= 9
        order = (["cudnn", "flash_attn", "flash"] if hopper else ["flash_attn", "flash", "cudnn"]) + order
    if deterministic:
        order = [name for name in order if name not in NONDETERMINISTIC_BWD]
    for name in order:
        if unsupported(name, device, dtype, head_dim, packed) is None:
            return name
    raise AssertionError("unreachable: math always runs")


def _check(q, k, v, mask):
    if isinstance(mask, torch.Tensor):
        if mask.dtype != torch.bool or tuple(mask.shape) != (q.shape[0], q.shape[1], k.shape[1]):
            raise ValueError(f"a tensor mask must be bool [b, sq, sk] = {(q.shape[0], q.shape[1], k.shape[1])}, "
                             f"got {mask.dtype} {tuple(mask.shape)}")
    elif mask not in MASKS:
        raise ValueError(f"mask must be one of {MASKS}, got {mask!r}")
    elif mask != "none" and q.shape[1] != k.shape[1]:
        raise ValueError(f"mask={mask!r} needs as many queries as keys, got sq={q.shape[1]}, sk={k.shape[1]}")
    if q.shape[2] % k.shape[2] != 0 or k.shape != v.shape:
        raise ValueError(f"bad block shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")


# ----------------------------------------------------------------------------------------- public
def block_fwd(q, k, v, *, mask: str = "none", scale: float | None = None, backend: str | None = None,
              chunk_size: int = MATH_CHUNK, cu_seqlens_q=None, cu_seqlens_k=None):
    """Attention of q over k, v with `mask`: (o [b, sq, h, d] in q.dtype, lse [b, h, sq] fp32; fp64 for fp64).
    cu_seqlens_q / _k: packed segments of the rows (b = 1; see the module docstring); _k defaults to _q."""
    _check(q, k, v, mask)
    scale = _scale(q, scale)
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        return _varlen_fwd(q, k, v, mask, scale, backend, chunk_size, *_pair(q, k, mask, cu_seqlens_q, cu_seqlens_k))
    if isinstance(mask, torch.Tensor):                # forward only (decoding): the math kernel takes any mask
        if backend not in (None, "math"):
            raise ValueError(f"backend={backend!r} cannot run a tensor mask; use backend='math' or None")
        if q.shape[1] == 0 or k.shape[1] == 0:
            return empty_result(q)
        return math_fwd(q, k, v, mask, scale, chunk_size)
    backend = select_backend(q.device, q.dtype, q.shape[-1], backend)
    sq = q.shape[1]
    if mask == "causal_strict":
        o, lse = empty_result(q)                      # row 0 sees nothing
        if sq > 1:
            o[:, 1:], lse[:, :, 1:] = strict_fwd(q, k, v, scale=scale, backend=backend, chunk_size=chunk_size)
        return o, lse
    if sq == 0 or k.shape[1] == 0:
        return empty_result(q)
    return _FWD[backend](q, k, v, mask == "causal", scale, chunk_size)


def block_bwd(do, q, k, v, o, lse, *, mask: str = "none", scale: float | None = None, backend: str | None = None,
              delta: torch.Tensor | None = None, chunk_size: int = MATH_CHUNK, cu_seqlens_q=None, cu_seqlens_k=None):
    """Gradients of one block from the global (o, lse) of its query rows.

    do, o [b, sq, h, d]; lse [b, h, sq] fp32 (global); delta [b, h, sq] fp32 = rowsum(do * o) may replace o
    (o=None), as BurstAttention circulates D instead of O: the kernel then gets surrogate_out(do, delta).
    Every backend derives D from the O it is handed. Returns (dq, dk, dv): fp32/fp64 from math, the input
    dtype from the fused kernels (which accumulate in fp32 inside). cu_seqlens_q / _k: as in block_fwd.
    """
    _check(q, k, v, mask)
    if o is None and delta is None:
        raise ValueError("block_bwd needs o or delta")
    scale = _scale(q, scale)
    packed = cu_seqlens_q is not None or cu_seqlens_k is not None
    segs = _pair(q, k, mask, cu_seqlens_q, cu_seqlens_k) if packed else None
    backend = select_backend(q.device, q.dtype, q.shape[-1], backend, packed=packed)
    if o is None:
        o = surrogate_out(do, delta)
    if packed:
        return _varlen_bwd(do, q, k, v, o, lse, mask, scale, backend, chunk_size, *segs)
    if mask == "causal_strict":
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        if q.shape[1] > 1:
            dq_s, dk_s, dv_s, ks = strict_bwd(do, q, k, v, o, lse, scale=scale, backend=backend, chunk_size=chunk_size)
            dq[:, 1:], dk[:, ks], dv[:, ks] = dq_s, dk_s, dv_s
        return dq, dk, dv
    if q.shape[1] == 0 or k.shape[1] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    return _BWD[backend](do, q, k, v, o, lse, mask == "causal", scale, chunk_size)


# ----------------------------------------------------------------------------------------- into accumulators
def block_fwd_into(o_acc, lse_acc, q, k, v, *, first: bool, mask: str = "none", scale: float | None = None,
                   backend: str | None = None, cu_seqlens_q=None):
    """One block's attention merged into running (o_acc [b, sq, h, d], lse_acc [b, h, sq]) fp32 (fp64) accumulators,
    views allowed; `first`: they hold nothing yet and are set to the block's result. A "causal_strict" block is
    `strict_fwd` written straight into rows 1: (row 0 sees no key), with no zero-filled block result and no copy
    of it (block_fwd's path): Attention2D has such a block in about half its pairs."""
    if mask == "causal_strict" and cu_seqlens_q is None:
        _check(q, k, v, mask)
        if first:
            o_acc[:, :1].zero_()
            lse_acc[:, :, :1].fill_(float("-inf"))
        if q.shape[1] <= 1:
            return
        o_acc, lse_acc = o_acc[:, 1:], lse_acc[:, :, 1:]
        o_b, lse_b = strict_fwd(q, k, v, scale=scale, backend=backend)
    else:
        o_b, lse_b = block_fwd(q, k, v, mask=mask, scale=scale, backend=backend, cu_seqlens_q=cu_seqlens_q)
    if first:
        accumulate_(o_acc, o_b, copy=True)
        lse_acc.copy_(lse_b)
    else:
        merge_(o_acc, lse_acc, o_b, lse_b)


def block_bwd_into(dq_acc, dk_acc, dv_acc, do, q, k, v, o, lse, *, first_q: bool, first_kv: bool, mask: str = "none",
                   scale: float | None = None, backend: str | None = None, cu_seqlens_q=None):
    """One block's gradients added into fp32 (fp64) accumulators dq_acc [b, sq, h, d], dk_acc, dv_acc [b, sk, h_kv, d]
    (views allowed); `first_q` / `first_kv`: that accumulator holds nothing yet and is set instead. o, lse: the
    global (or surrogate) O and lse of the query rows, as in block_bwd. A "causal_strict" block runs `strict_bwd`
    and adds into the rows it covers (row 0 of dq gets nothing, nor the last key row where the call leaves it out),
    without block_bwd's zero-filled full-size gradients and their copies."""
    if mask == "causal_strict" and cu_seqlens_q is None:
        _check(q, k, v, mask)
        if q.shape[1] <= 1:                           # no query sees a key
            for x, first in ((dq_acc, first_q), (dk_acc, first_kv), (dv_acc, first_kv)):
                if first:
                    x.zero_()
            return
        dq, dk, dv, ks = strict_bwd(do, q, k, v, o, lse, scale=scale, backend=backend)
        if first_q:
            dq_acc[:, :1].zero_()
        if first_kv and ks.stop is not None:          # the last key: no query sees it, the call does not write it
            dk_acc[:, ks.stop:].zero_()
            dv_acc[:, ks.stop:].zero_()
        dq_acc, dk_acc, dv_acc = dq_acc[:, 1:], dk_acc[:, ks], dv_acc[:, ks]
    else:
        dq, dk, dv = block_bwd(do, q, k, v, o, lse, mask=mask, scale=scale, backend=backend,
                               cu_seqlens_q=cu_seqlens_q)
    accumulate_(dq_acc, dq, copy=first_q)
    accumulate_(dk_acc, dk, copy=first_kv)
    accumulate_(dv_acc, dv, copy=first_kv)


def _scale(q, scale):
    """The softmax scale: `scale`, or 1 / sqrt(head dim) where None (flash-attn's softmax_scale=None)."""
    return q.shape[-1] ** -0.5 if scale is None else scale


def _strict_keys(backend: str, sk: int) -> slice:
    """The keys a "causal_strict" block's causal kernel call reads: all of them where the mask is aligned at the
    top left (`TOP_LEFT`), else k[:-1] (q[1:] then sees keys j <= i - 1)."""
    return slice(None) if backend in TOP_LEFT else slice(0, sk - 1)


def strict_fwd(q, k, v, *, scale: float | None = None, backend: str | None = None, chunk_size: int = MATH_CHUNK):
    """Rows 1: of a "causal_strict" block (sq = sk > 1) as one causal kernel call, for callers that write them in
    place: (o [b, sq - 1, h, d] in q.dtype, lse [b, h, sq - 1] fp32); row 0 sees no key."""
    _check(q, k, v, "causal_strict")
    backend = select_backend(q.device, q.dtype, q.shape[-1], backend)
    ks = _strict_keys(backend, k.shape[1])
    return _FWD[backend](q[:, 1:], k[:, ks], v[:, ks], True, _scale(q, scale), chunk_size)


def strict_bwd(do, q, k, v, o, lse, *, scale: float | None = None, backend: str | None = None,
               chunk_size: int = MATH_CHUNK):
    """The gradients of a "causal_strict" block (sq = sk > 1) from one causal kernel call, o the global (or
    surrogate) O: (dq of rows 1:, dk, dv of the key rows ks, ks); rows outside them get nothing (row 0 of dq, and
    the last key where ks stops before it)."""
    _check(q, k, v, "causal_strict")
    backend = select_backend(q.device, q.dtype, q.shape[-1], backend)
    ks = _strict_keys(backend, k.shape[1])
    dq, dk, dv = _BWD[backend](do[:, 1:], q[:, 1:], k[:, ks], v[:, ks], o[:, 1:], lse[:, :, 1:], True,
                               _scale(q, scale), chunk_size)
    return dq, dk, dv, ks


# ----------------------------------------------------------------------------------------- packed
def _pair(q, k, mask, cu_q, cu_k) -> tuple[Segments, Segments]:
    """Validated (query, key) segments of a packed block."""
    if isinstance(mask, torch.Tensor):
        raise ValueError("a tensor mask cannot be combined with cu_seqlens")
    sq = Segments.of(cu_q if cu_q is not None else cu_k)
    sk = Segments.of(cu_k if cu_k is not None else cu_q)
    if q.shape[0] != 1:
        raise ValueError(f"cu_seqlens: packed blocks have batch 1, got q {tuple(q.shape)}")
    if sq.rows != q.shape[1] or sk.rows != k.shape[1] or sq.count != sk.count:
        raise ValueError(f"cu_seqlens_q must end at sq = {q.shape[1]} and cu_seqlens_k at sk = {k.shape[1]}, with as "
                         f"many segments; got {sq.count} ending at {sq.rows} and {sk.count} ending at {sk.rows}")
    if mask != "none" and sq != sk:
        raise ValueError(f"mask={mask!r} with cu_seqlens needs equal query and key segments")
    return sq, sk


def _varlen_fwd(q, k, v, mask, scale, backend, chunk, sq: Segments, sk: Segments):
    backend = select_backend(q.device, q.dtype, q.shape[-1], backend, packed=True)
    if mask == "causal_strict":
        o, lse = empty_result(q)
        if sq.rows > 1:
            view, dead = strict_view(sq)
            o_v, lse_v = _VARLEN_FWD[backend](q[:, 1:], k[:, :-1], v[:, :-1], view, view, True, scale, chunk)
            if dead:                                        # the dummy rows between documents see nothing
                idx = index_tensor(dead, q.device)
                o_v[:, idx] = 0
                lse_v[:, :, idx] = float("-inf")
            o[:, 1:], lse[:, :, 1:] = o_v, lse_v
        return o, lse
    sq, sk = nonempty(sq, sk)
    if sq.rows == 0 or sk.rows == 0:
        return empty_result(q)
    return _VARLEN_FWD[backend](q, k, v, sq, sk, mask == "causal", scale, chunk)


def _varlen_bwd(do, q, k, v, o, lse, mask, scale, backend, chunk, sq: Segments, sk: Segments):
    if mask == "causal_strict":
        if sq.rows <= 1:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        view, dead = strict_view(sq)
        lse_v = lse[:, :, 1:]
        if dead:                                            # P = exp(S - inf) = 0: the dummies add nothing
            lse_v = lse_v.clone()
            lse_v[:, :, index_tensor(dead, q.device)] = float("inf")
        g = _VARLEN_BWD[backend](do[:, 1:], q[:, 1:], k[:, :-1], v[:, :-1], o[:, 1:], lse_v, view, view, True, scale,
                                 chunk)
        out = tuple(x.new_zeros(t.shape) for x, t in zip(g, (q, k, v)))
        out[0][:, 1:], out[1][:, :-1], out[2][:, :-1] = g
        return out
    sq, sk = nonempty(sq, sk)
    if sq.rows == 0 or sk.rows == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    return _VARLEN_BWD[backend](do, q, k, v, o, lse, sq, sk, mask == "causal", scale, chunk)


# ----------------------------------------------------------------------------------------- decode
DECODE_BACKENDS = ("triton", *BACKENDS)


def decode_fwd(q, k, v, *, scale: float | None = None, kv_positions: torch.Tensor | None = None,
               q_positions: torch.Tensor | None = None, backend: str | None = None):
    """Decode-step partial of a few queries over a (local) cache: (o [b, n_q, h, d], lse [b, h, n_q]), both in
    acc_dtype(q.dtype).

    q [b, n_q, h, d]; k, v [b, s, h_kv, d], any view with a contiguous last dim. Key j is visible to query i
    iff 0 <= kv_positions[j] (-1 = empty slot) and kv_positions[j] <= q_positions[i]; no positions: all keys.
    backend None: the split-KV Triton kernel (`flash_decode.py`) on GPUs for fp16/bf16, the fused prefill
    kernel without a mask otherwise, the math kernel for a mask on CPU. "triton" forces the Triton kernel
    (under TRITON_INTERPRET=1 it runs on CPU tensors too).
    """
    if backend is not None and backend not in DECODE_BACKENDS:
        raise ValueError(f"backend must be one of {DECODE_BACKENDS} or None, got {backend!r}")
    triton_ok = fd.available(q.device) and q.shape[-1] in fd.HEAD_DIMS and q.dtype != torch.float64
    if backend == "triton" and not triton_ok:
        raise ValueError(f"backend='triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1), fp16/bf16/fp32 "
                         f"and head_dim in {fd.HEAD_DIMS}; got {q.device}, {q.dtype}, head_dim {q.shape[-1]}")
    if backend == "triton" or (backend is None and triton_ok and q.device.type == "cuda"
                               and q.dtype in (torch.float16, torch.bfloat16)):
        return fd.flash_decode(q, k, v, scale=scale, kv_positions=kv_positions, q_positions=q_positions)
    acc = acc_dtype(q.dtype)
    if kv_positions is None and q_positions is None:
        o, lse = block_fwd(q, k, v, scale=scale, backend=backend)
        return o.to(acc), lse.to(acc)
    b, n_q, s = q.shape[0], q.shape[1], k.shape[1]
    kv = kv_positions if kv_positions is not None else torch.arange(s, device=q.device).expand(b, s)
    vis = (kv >= 0)[:, None, :].expand(b, n_q, s)
    if q_positions is not None:
        vis = vis & (kv[:, None, :] <= q_positions[:, :, None])
    o, lse = block_fwd(q, k, v, mask=vis, scale=scale, backend=None if backend == "math" else backend)
    return o.to(acc), lse.to(acc)


def sdpa_over_cache(q, k, v, lengths, scale=None):
    """The anchor a single-GPU user would write: torch's scaled_dot_product_attention of q [b, 1, h, d] over the
    cache k, v [b, s, h_kv, d], slots at or past lengths [b] masked; -> [b, 1, h, d]. The g = h / h_kv query heads
    of a KV head go in as g query rows of it (no GQA expansion, each K, V read once), and the boolean mask over
    the whole capacity keeps the shapes static, so the step can be captured (torch picks cuDNN's fused attention
    for this masked bf16 call on an H100: 0.2 TB/s of cache read, docs/decode.md)."""
    b, n, h, d = q.shape
    if n != 1:
        raise ValueError(f"sdpa_over_cache: one new token per sequence, got q {tuple(q.shape)}")
    h_kv = k.shape[2]
    qg = q.reshape(b, h_kv, h // h_kv, d)                               # head = KV head * g + j, as GQA groups them
    mask = (torch.arange(k.shape[1], device=k.device) < lengths[:, None])[:, None, None, :]
    o = torch.nn.functional.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2),
                                                         attn_mask=mask, scale=scale)
    return o.reshape(b, 1, h, d)


# ----------------------------------------------------------------------------------------- fused
def _bhsd(x):
    return x.transpose(1, 2)


def _empty_philox(device):
    return torch.empty((), dtype=torch.int64, device=device)


def _cudnn_fwd(q, k, v, causal, scale, _chunk):
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _bhsd(q), _bhsd(k), _bhsd(v), None, True, 0.0, causal, False, scale=scale)
    return _bhsd(r[0]), r[1].reshape(q.shape[0], q.shape[2], q.shape[1])


def _cudnn_bwd(do, q, k, v, o, lse, causal, scale, _chunk):
    # torch 2.11 caches the cuDNN backward plan by q, k, v shapes and strides only, so a later call with
    # other dO / O strides reads them with the first call's layout (wrong gradients, seen on H200): always
    # pass them in one layout, fixed by their shape.
    do, o = do.contiguous(), o.contiguous()
    ph = _empty_philox(q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        _bhsd(do), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(o), lse.contiguous().unsqueeze(-1), ph, ph, None,
        None, None, q.shape[1], k.shape[1], 0.0, causal, scale=scale)
    return _bhsd(dq), _bhsd(dk), _bhsd(dv)


def _flash_fwd(q, k, v, causal, scale, _chunk):
    r = torch.ops.aten._scaled_dot_product_flash_attention(_bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, False,
                                                           scale=scale)
    return _bhsd(r[0]), r[1]


def _flash_bwd(do, q, k, v, o, lse, causal, scale, _chunk):
    # Dropout is 0, so the rng state is never read; FA2 wants a 2-element uint64 tensor all the same.
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        _bhsd(do), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(o), lse.contiguous(), None, None, q.shape[1], k.shape[1],
        0.0, causal, rng, unused, scale=scale)
    return _bhsd(dq), _bhsd(dk), _bhsd(dv)


def _fa_kwargs(fn, causal, scale):
    """Keyword arguments for flash-attn's private fwd/bwd across versions (2.5 took `window_size=(l, r)`,
    2.6+ takes `window_size_left/right` and `softcap`)."""
    names = inspect.signature(fn).parameters
    kw = {"dropout_p": 0.0, "softmax_scale": scale, "causal": causal, "alibi_slopes": None}
    if "window_size_left" in names:
        kw.update(window_size_left=-1, window_size_right=-1)
    elif "window_size" in names:
        kw["window_size"] = (-1, -1)
    if "softcap" in names:
        kw["softcap"] = 0.0
    return {n: val for n, val in kw.items() if n in names}


def _fa_fwd(q, k, v, causal, scale, _chunk):
    fn = _flash_attn_module()._flash_attn_forward
    r = fn(q.contiguous(), k.contiguous(), v.contiguous(), return_softmax=False, **_fa_kwargs(fn, causal, scale))
    return r[0], r[1]


def _fa_bwd(do, q, k, v, o, lse, causal, scale, _chunk):
    fn = _flash_attn_module()._flash_attn_backward
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    kw = _fa_kwargs(fn, causal, scale)
    if "deterministic" in inspect.signature(fn).parameters:
        kw["deterministic"] = torch.are_deterministic_algorithms_enabled()   # --deterministic-mode
    fn(do.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), o.contiguous(), lse.contiguous(),
       dq, dk, dv, **kw)
    return dq, dk, dv


# Varlen: q, k, v [1, s, h, d] -> the kernels' [total, h, d]; lse [h, total] (FA2 >= 2.4, unpadded).
def _lse_out(lse):
    """A row whose key segment is empty comes back with lse = +inf (FA2's convention); ours is -inf."""
    return torch.where(lse == float("inf"), torch.full_like(lse, float("-inf")), lse)[None]


def _lse_in(lse):
    """Our -inf rows (saw no key) as FA2's backward wants them: +inf, so that P = exp(S - lse) = 0."""
    lse = lse[0]
    return torch.where(lse == float("-inf"), torch.full_like(lse, float("inf")), lse).contiguous()


def _thd(*xs):
    return tuple(x[0].contiguous() for x in xs)


def _flash_varlen_fwd(q, k, v, sq, sk, causal, scale, _chunk):
    dev = q.device
    r = torch.ops.aten._flash_attention_forward(*_thd(q, k, v), sq.cu(dev), sk.cu(dev), sq.max_len, sk.max_len,
                                                0.0, causal, False, scale=scale)
    return r[0][None], _lse_out(r[1])


def _flash_varlen_bwd(do, q, k, v, o, lse, sq, sk, causal, scale, _chunk):
    dev = q.device
    rng = torch.zeros(2, dtype=torch.uint64, device=dev)         # dropout 0: never read, as in _flash_bwd
    unused = torch.empty((), dtype=torch.uint64, device=dev)
    g = torch.ops.aten._flash_attention_backward(*_thd(do, q, k, v, o), _lse_in(lse), sq.cu(dev), sk.cu(dev),
                                                 sq.max_len, sk.max_len, 0.0, causal, rng, unused, scale=scale)
    return tuple(x[None] for x in g)


def _fa_varlen_fwd(q, k, v, sq, sk, causal, scale, _chunk):
    fn, dev = _flash_attn_module()._flash_attn_varlen_forward, q.device
    r = fn(*_thd(q, k, v), sq.cu(dev), sk.cu(dev), sq.max_len, sk.max_len, return_softmax=False,
           **_fa_kwargs(fn, causal, scale))
    return r[0][None], _lse_out(r[1])


def _fa_varlen_bwd(do, q, k, v, o, lse, sq, sk, causal, scale, _chunk):
    fn, dev = _flash_attn_module()._flash_attn_varlen_backward, q.device
    do3, q3, k3, v3, o3 = _thd(do, q, k, v, o)
    dq, dk, dv = torch.empty_like(q3), torch.empty_like(k3), torch.empty_like(v3)
    kw = _fa_kwargs(fn, causal, scale)
    if "deterministic" in inspect.signature(fn).parameters:
        kw["deterministic"] = torch.are_deterministic_algorithms_enabled()   # --deterministic-mode
    fn(do3, q3, k3, v3, o3, _lse_in(lse), dq, dk, dv, sq.cu(dev), sk.cu(dev), sq.max_len, sk.max_len, **kw)
    return dq[None], dk[None], dv[None]


def _math_varlen_fwd(q, k, v, sq, sk, causal, scale, chunk):
    return math_fwd(q, k, v, causal, scale, chunk, math_segments(sq, sk, q.device))


def _math_varlen_bwd(do, q, k, v, o, lse, sq, sk, causal, scale, chunk):
    return math_bwd(do, q, k, v, o, lse, causal, scale, chunk, math_segments(sq, sk, q.device))


_FWD = {"cudnn": _cudnn_fwd, "flash": _flash_fwd, "flash_attn": _fa_fwd, "math": math_fwd}
_BWD = {"cudnn": _cudnn_bwd, "flash": _flash_bwd, "flash_attn": _fa_bwd, "math": math_bwd}
_VARLEN_FWD = {"flash": _flash_varlen_fwd, "flash_attn": _fa_varlen_fwd, "math": _math_varlen_fwd}
_VARLEN_BWD = {"flash": _flash_varlen_bwd, "flash_attn": _fa_varlen_bwd, "math": _math_varlen_bwd}
