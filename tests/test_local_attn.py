"""Single-device kernels (block_fwd / block_bwd, merge_, surrogate_out, select_backend) against the fp64
naive reference. CPU tests run the "math" backend; the fused backends ("cudnn", "flash") run only on a GPU."""
from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from megatron_cp_plugin.kernels.local_attn import (
    BACKENDS,
    MASKS,
    surrogate_out,
    acc_dtype,
    attention_delta,
    block_bwd,
    block_fwd,
    select_backend,
)
from megatron_cp_plugin.kernels.merge import merge_
from megatron_cp_plugin.kernels.reference import attention_reference

HEADS = ((8, 8), (8, 2))          # MHA and GQA with h / h_kv = 4
BATCH = 2
GRADS = ("dq", "dk", "dv")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: run on the device machine")


# ------------------------------------------------------------------------------------------- helpers
def _inputs(seed, sq, sk, h, hk, d, dtype, device="cpu", b=BATCH):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g)
    k = torch.randn(b, sk, hk, d, generator=g)
    v = torch.randn(b, sk, hk, d, generator=g)
    do = torch.randn(b, sq, h, d, generator=g)
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v, do))


def _reference(q, k, v, do, mask):
    """fp64 (o, lse, dq, dk, dv) of the naive reference, on the given (already rounded) inputs."""
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    o, lse = attention_reference(qr, kr, vr, mask=mask)
    grads = torch.autograd.grad(o, (qr, kr, vr), do.double())
    return {"o": o.detach(), "lse": lse.detach(), **dict(zip(GRADS, grads))}


def _rel(x, ref):
    """Max-norm relative error."""
    return ((x.double() - ref).abs().max() / ref.abs().max()).item()


def _rel_l2(x, ref):
    """Frobenius-norm relative error."""
    return (torch.linalg.vector_norm(x.double() - ref) / torch.linalg.vector_norm(ref)).item()


def _lse_err(lse, ref):
    """Max absolute lse error over finite rows; asserts the -inf rows are the same on both sides."""
    assert not torch.isnan(lse).any()
    inf, inf_ref = torch.isinf(lse), torch.isinf(ref)
    assert torch.equal(inf, inf_ref), "lse is -inf on other rows than the reference"
    assert (lse[inf] < 0).all()
    if inf.all():
        return 0.0
    return (lse.double()[~inf] - ref[~inf]).abs().max().item()


def _finite(*ts):
    return all(torch.isfinite(t).all().item() for t in ts)


# ------------------------------------------------------------------------------------------- 1. math vs fp64
SHAPES = [(mask, 37, 37) for mask in MASKS] + [("none", 13, 29)]      # odd lengths; sq != sk non-causal


@pytest.mark.parametrize("chunk", (1, 8, 512))
@pytest.mark.parametrize("d", (16, 24))
@pytest.mark.parametrize("h,hk", HEADS, ids=["mha", "gqa"])
@pytest.mark.parametrize("mask,sq,sk", SHAPES, ids=[f"{m}-{a}x{b}" for m, a, b in SHAPES])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)], ids=["fp64", "fp32"])
def test_math_matches_reference(dtype, tol, mask, sq, sk, h, hk, d, chunk):
    seed = zlib.crc32(repr((dtype, mask, sq, sk, h, hk, d, chunk)).encode())
    q, k, v, do = _inputs(seed, sq, sk, h, hk, d, dtype)
    ref = _reference(q, k, v, do, mask)
    o, lse = block_fwd(q, k, v, mask=mask, backend="math", chunk_size=chunk)
    assert o.dtype == dtype and o.shape == q.shape
    assert lse.dtype == acc_dtype(dtype) and lse.shape == (BATCH, h, sq)
    dq, dk, dv = block_bwd(do, q, k, v, o, lse, mask=mask, backend="math", chunk_size=chunk)
    got = {"o": o, "dq": dq, "dk": dk, "dv": dv}
    assert _finite(o, dq, dk, dv)
    for n, x in got.items():
        assert x.shape == ref[n].shape, n
        if n != "o":
            assert x.dtype == acc_dtype(dtype), n
        err = _rel(x, ref[n])
        assert err <= tol, f"{n}: max-norm rel err {err:.3g} > {tol:.3g}"
    err = _lse_err(lse, ref["lse"])
    assert err <= tol * ref["lse"][torch.isfinite(ref["lse"])].abs().max().item(), f"lse: abs err {err:.3g}"


@pytest.mark.parametrize("chunk", (8, 512))
@pytest.mark.parametrize("h,hk", HEADS, ids=["mha", "gqa"])
@pytest.mark.parametrize("mask,sq,sk", SHAPES, ids=[f"{m}-{a}x{b}" for m, a, b in SHAPES])
def test_math_bf16_close_to_reference(mask, sq, sk, h, hk, chunk):
    q, k, v, do = _inputs(11, sq, sk, h, hk, 24, torch.bfloat16)
    ref = _reference(q, k, v, do, mask)
    o, lse = block_fwd(q, k, v, mask=mask, backend="math", chunk_size=chunk)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    grads = block_bwd(do, q, k, v, o, lse, mask=mask, backend="math", chunk_size=chunk)
    got = dict(zip(("o",) + GRADS, (o,) + grads))
    assert _finite(*got.values())
    for n, x in got.items():
        err = _rel(x, ref[n])
        assert err <= 2e-2, f"{n}: max-norm rel err {err:.3g}"
    assert _lse_err(lse, ref["lse"]) <= 1e-3


# ------------------------------------------------------------------------------------------- 2. delta in place of o
DTYPE_CHUNKS = [(torch.float64, 1), (torch.float64, 8), (torch.float64, 512), (torch.float32, 8),
                (torch.float32, 512), (torch.bfloat16, 8), (torch.bfloat16, 512)]


@pytest.mark.parametrize("h,hk", HEADS, ids=["mha", "gqa"])
@pytest.mark.parametrize("mask,sq,sk", SHAPES, ids=[f"{m}-{a}x{b}" for m, a, b in SHAPES])
@pytest.mark.parametrize("dtype,chunk", DTYPE_CHUNKS, ids=[f"{str(t)[6:]}-c{c}" for t, c in DTYPE_CHUNKS])
def test_bwd_with_delta_equals_bwd_with_o(dtype, chunk, mask, sq, sk, h, hk):
    q, k, v, do = _inputs(5, sq, sk, h, hk, 16, dtype)
    o, lse = block_fwd(q, k, v, mask=mask, chunk_size=chunk)
    delta = attention_delta(do, o)
    assert delta.dtype == acc_dtype(dtype) and delta.shape == lse.shape
    with_o = block_bwd(do, q, k, v, o, lse, mask=mask, chunk_size=chunk)
    with_d = block_bwd(do, q, k, v, None, lse, mask=mask, delta=delta, chunk_size=chunk)
    for n, a, b in zip(GRADS, with_o, with_d):
        assert a.dtype == b.dtype and a.shape == b.shape, n
        # D through the surrogate is exact to the accumulator: a few ulps of fp32 (fp64) apart.
        assert _rel(a, b.double()) <= (1e-13 if dtype == torch.float64 else 1e-6), n


def test_bwd_needs_o_or_delta():
    q, k, v, do = _inputs(0, 5, 5, 4, 4, 8, torch.float32)
    o, lse = block_fwd(q, k, v)
    with pytest.raises(ValueError, match="o or delta"):
        block_bwd(do, q, k, v, None, lse)


def _strided(x, how):
    """The same values as x [b, s, h, d] in another memory layout: "sbhd" (Megatron's [s, b, h, d] storage,
    transposed) or "padded" (a slice of a tensor with twice the heads)."""
    if how == "sbhd":
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    big = torch.zeros(*x.shape[:2], 2 * x.shape[2], x.shape[3], dtype=x.dtype, device=x.device)
    big[:, :, :x.shape[2]] = x
    return big[:, :, :x.shape[2]]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("how", ("sbhd", "padded"))
def test_math_strided_inputs(how, mask):
    q, k, v, do = _inputs(20, 37, 37, 8, 2, 16, torch.float64)
    o, lse = block_fwd(q, k, v, mask=mask, chunk_size=8)
    grads = block_bwd(do, q, k, v, o, lse, mask=mask, chunk_size=8)
    qs, ks, vs, dos, os_ = (_strided(t, how) for t in (q, k, v, do, o))
    assert not qs.is_contiguous() and torch.equal(qs, q)
    o2, lse2 = block_fwd(qs, ks, vs, mask=mask, chunk_size=8)
    assert torch.allclose(o2, o, rtol=0, atol=1e-13) and torch.equal(torch.isinf(lse2), torch.isinf(lse))
    for g, g2 in zip(grads, block_bwd(dos, qs, ks, vs, os_, lse, mask=mask, chunk_size=8)):
        assert torch.allclose(g2, g, rtol=0, atol=1e-13)


# ------------------------------------------------------------------------------------------- 3. causal_strict
@pytest.mark.parametrize("use_delta", (False, True), ids=["o", "delta"])
@pytest.mark.parametrize("chunk", (1, 8, 512))
@pytest.mark.parametrize("dtype", (torch.float64, torch.float32, torch.bfloat16), ids=["fp64", "fp32", "bf16"])
def test_causal_strict_empty_first_row(dtype, chunk, use_delta):
    q, k, v, do = _inputs(3, 37, 37, 8, 2, 16, dtype)
    o, lse = block_fwd(q, k, v, mask="causal_strict", chunk_size=chunk)
    kw = {"delta": attention_delta(do, o)} if use_delta else {}
    dq, dk, dv = block_bwd(do, q, k, v, None if use_delta else o, lse, mask="causal_strict", chunk_size=chunk, **kw)
    assert not any(torch.isnan(t).any() for t in (o, lse, dq, dk, dv))
    assert _finite(o, lse[:, :, 1:], dq, dk, dv)
    assert (lse[:, :, 0] == float("-inf")).all()
    assert (o[:, 0] == 0).all() and (dq[:, 0] == 0).all()
    assert (dk[:, -1] == 0).all() and (dv[:, -1] == 0).all()      # the last key is seen by no query
    assert (o[:, 1] == v[:, 0].repeat_interleave(4, 1)).all()      # row 1 sees key 0 alone


@pytest.mark.parametrize("use_delta", (False, True), ids=["o", "delta"])
@pytest.mark.parametrize("dtype", (torch.float64, torch.float32, torch.bfloat16), ids=["fp64", "fp32", "bf16"])
def test_causal_strict_single_row(dtype, use_delta):
    q, k, v, do = _inputs(4, 1, 1, 8, 2, 16, dtype)
    o, lse = block_fwd(q, k, v, mask="causal_strict")
    assert o.shape == q.shape and o.dtype == dtype and lse.shape == (BATCH, 8, 1) and lse.dtype == acc_dtype(dtype)
    assert (o == 0).all() and (lse == float("-inf")).all()
    kw = {"delta": attention_delta(do, o)} if use_delta else {}
    grads = block_bwd(do, q, k, v, None if use_delta else o, lse, mask="causal_strict", **kw)
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and (g == 0).all() and not torch.isnan(g).any()


# ------------------------------------------------------------------------------------------- 4. empty blocks
@pytest.mark.parametrize("use_delta", (False, True), ids=["o", "delta"])
@pytest.mark.parametrize("mask,sq,sk", [("none", 6, 0), ("none", 0, 7), ("none", 0, 0), ("causal", 0, 0),
                                        ("causal_strict", 0, 0)])
@pytest.mark.parametrize("dtype", (torch.float64, torch.float32, torch.bfloat16), ids=["fp64", "fp32", "bf16"])
def test_empty_blocks(dtype, mask, sq, sk, use_delta):
    q, k, v, do = _inputs(6, sq, sk, 8, 2, 16, dtype)
    o, lse = block_fwd(q, k, v, mask=mask)
    assert o.shape == q.shape and o.dtype == dtype
    assert lse.shape == (BATCH, 8, sq) and lse.dtype == acc_dtype(dtype)
    assert (o == 0).all() and (lse == float("-inf")).all()
    kw = {"delta": attention_delta(do, o)} if use_delta else {}
    grads = block_bwd(do, q, k, v, None if use_delta else o, lse, mask=mask, **kw)
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and (g == 0).all() and not torch.isnan(g).any()


# ------------------------------------------------------------------------------------------- 5. merge_
@pytest.mark.parametrize("h,hk", HEADS, ids=["mha", "gqa"])
@pytest.mark.parametrize("split", (1, 17, 40))
def test_merge_two_key_halves_equals_all_keys(h, hk, split):
    q, k, v, _ = _inputs(8, 37, 41, h, hk, 24, torch.float64)
    o_all, lse_all = block_fwd(q, k, v)
    o1, lse1 = block_fwd(q, k[:, :split], v[:, :split])
    o2, lse2 = block_fwd(q, k[:, split:], v[:, split:])
    o, lse = o1.clone(), lse1.clone()
    merge_(o, lse, o2, lse2)
    assert _rel(o, o_all) <= 1e-12 and _rel(lse, lse_all) <= 1e-12
    o, lse = o2.clone(), lse2.clone()                                  # the other order
    merge_(o, lse, o1, lse1)
    assert _rel(o, o_all) <= 1e-12 and _rel(lse, lse_all) <= 1e-12
    # From the empty accumulator (o = 0, lse = -inf), as the algorithms start.
    o, lse = torch.zeros_like(o1), torch.full_like(lse1, float("-inf"))
    merge_(o, lse, o1, lse1)
    assert torch.equal(o, o1) and torch.equal(lse, lse1)
    merge_(o, lse, o2, lse2)
    assert _rel(o, o_all) <= 1e-12 and _rel(lse, lse_all) <= 1e-12


def test_merge_fp32_accumulator_bf16_partials():
    q, k, v, _ = _inputs(9, 37, 40, 8, 2, 16, torch.bfloat16)
    o_all, lse_all = block_fwd(q.double(), k.double(), v.double())
    o, lse = torch.zeros(q.shape, dtype=torch.float32), torch.full((BATCH, 8, 37), float("-inf"))
    for j in range(0, 40, 10):
        merge_(o, lse, *block_fwd(q, k[:, j:j + 10], v[:, j:j + 10]))
    assert o.dtype == torch.float32 and lse.dtype == torch.float32
    assert _rel(o, o_all) <= 2e-2 and (lse.double() - lse_all).abs().max() <= 1e-3


def test_merge_with_minus_inf_rows():
    q, k, v, _ = _inputs(10, 37, 41, 8, 2, 16, torch.float64)
    o_all, lse_all = block_fwd(q, k, v)
    o1, lse1 = block_fwd(q, k[:, :20], v[:, :20])
    o2, lse2 = block_fwd(q, k[:, 20:], v[:, 20:])
    only2, only1, neither = slice(0, 5), slice(5, 9), slice(9, 12)
    # Side 1 empty on rows 0-4 and 9-11, side 2 empty on rows 5-11.
    for o_, lse_, rows in ((o1, lse1, (only2, neither)), (o2, lse2, (only1, neither))):
        for r in rows:
            o_[:, r] = 0
            lse_[:, :, r] = float("-inf")
    full = slice(12, 37)
    for a, b in (((o1, lse1), (o2, lse2)), ((o2, lse2), (o1, lse1))):
        o, lse = a[0].clone(), a[1].clone()
        merge_(o, lse, *b)
        assert not torch.isnan(o).any() and not torch.isnan(lse).any()
        assert torch.isfinite(o).all()
        assert _rel(o[:, full], o_all[:, full]) <= 1e-12
        assert _rel(lse[:, :, full], lse_all[:, :, full]) <= 1e-12
        assert torch.allclose(o[:, only2], o2[:, only2], rtol=1e-14, atol=0)          # -inf is the identity
        assert torch.allclose(lse[:, :, only2], lse2[:, :, only2], rtol=1e-14, atol=0)
        assert torch.allclose(o[:, only1], o1[:, only1], rtol=1e-14, atol=0)
        assert torch.allclose(lse[:, :, only1], lse1[:, :, only1], rtol=1e-14, atol=0)
        assert (o[:, neither] == 0).all() and (lse[:, :, neither] == float("-inf")).all()


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32), ids=["fp64", "fp32"])
def test_merge_causal_strict_with_diagonal_equals_causal(dtype):
    """causal = causal_strict (row 0 empty, lse = -inf from the kernel itself) merged with the diagonal."""
    q, k, v, _ = _inputs(12, 37, 37, 8, 2, 24, dtype)
    o_c, lse_c = block_fwd(q, k, v, mask="causal")
    o, lse = block_fwd(q, k, v, mask="causal_strict")
    o, lse = o.to(acc_dtype(dtype)), lse.clone()
    kk = k.repeat_interleave(4, 2)
    lse_diag = ((q * kk).sum(-1) * q.shape[-1] ** -0.5).transpose(1, 2).to(lse.dtype)
    merge_(o, lse, v.repeat_interleave(4, 2), lse_diag)                # one key per row: o = v_i
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    assert _rel(o, o_c) <= tol and _rel(lse, lse_c) <= tol


# ------------------------------------------------------------------------------------------- 6. surrogate_out
def _rowsum(do, out):
    """rowsum(do * out) as the kernels form D: exact products, summed in fp32 (fp64 for fp64)."""
    return attention_delta(do, out)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32, torch.float64),
                         ids=["bf16", "fp16", "fp32", "fp64"])
@pytest.mark.parametrize("delta_kind", ("randn", "scaled", "rowsum"))
def test_surrogate_out_reproduces_delta(dtype, delta_kind):
    g = torch.Generator().manual_seed(13)
    do = torch.randn(2, 33, 4, 64, generator=g).to(dtype)
    if delta_kind == "randn":
        delta = torch.randn(2, 4, 33, generator=g)
    elif delta_kind == "scaled":                                       # magnitudes over 8 decades
        delta = torch.randn(2, 4, 33, generator=g) * 10.0 ** torch.randint(-4, 5, (2, 4, 33), generator=g)
    else:                                                              # a real D = rowsum(dO * O)
        o = torch.randn(2, 33, 4, 64, generator=g).to(dtype)
        delta = attention_delta(do, o)
    delta = delta.to(acc_dtype(dtype))
    do[:, 7] = 0                                                       # rows with dO = 0 and D = 0
    do[1, 20, 2] = 0
    delta[:, :, 7] = 0
    delta[1, 2, 20] = 0
    out = surrogate_out(do, delta)
    assert out.dtype == dtype and out.shape == do.shape
    assert torch.isfinite(out).all()
    got = _rowsum(do, out)
    assert torch.isfinite(got).all()
    # D to the accuracy of the accumulator (fp32 or fp64), not of the 16-bit dtype. fp16 turns subnormal
    # below 2^-14, which leaves an absolute floor of a few 2^-24 * max|dO| (harmless next to dP - D in the
    # kernel, but no longer relative to a small D).
    eps = torch.finfo(acc_dtype(dtype)).eps
    floor = 0 if dtype != torch.float16 else 4 * 2.0**-24 * do.float().abs().amax(-1).transpose(1, 2)
    excess = ((got.double() - delta.double()).abs() - floor).clamp_min(0) / delta.double().abs().clamp_min(1e-300)
    assert excess.max().item() <= 8 * eps, f"per-element rel err {excess.max().item():.3g}"
    assert (out[:, 7] == 0).all() and (out[1, 20, 2] == 0).all()


def test_surrogate_out_fp16_large_delta_stays_finite():
    """A legal fp16 block: V = 600 everywhere (so O = 600), d = 128, dO = 0.9 with one 1.0 per row.
    D = 600 * (1 + 127 * 0.9) = 69180 (finite, fp32); D / max|dO| > 65504 does not fit fp16."""
    do = torch.full((1, 3, 2, 128), 0.9, dtype=torch.float16)
    do[..., 5] = 1.0
    o = torch.full_like(do, 600.0)
    delta = attention_delta(do, o)
    out = surrogate_out(do, delta)
    assert torch.isfinite(out).all()
    assert _rel(_rowsum(do, out), delta.double()) <= 1e-6


def fp16_large_case(case: str):
    """(dO, O) fp16 on the CPU whose D only a saturated surrogate carries: |D| near max|O| * sum|dO| with O at or
    near 65504 (also tests/test_surrogate.py's, for the kernel)."""
    g = torch.Generator().manual_seed(15)
    if case == "v600":                             # D / max|dO| > 65504
        do = torch.full((1, 3, 2, 128), 0.9, dtype=torch.float16)
        do[..., 5] = 1.0
        return do, torch.full_like(do, 600.0)
    if case == "issue15":
        do = torch.full((1, 5, 2, 128), 0.5, dtype=torch.float16)
        return do, (1500 + torch.randn(1, 5, 2, 128, generator=g)).half()
    if case == "o_at_max":                         # the extreme: every entry of O at +-65504 along dO
        do = torch.randn(1, 5, 2, 128, generator=g).half()
        return do, torch.where(do > 0, 65504.0, -65504.0).half()
    do = torch.full((1, 5, 2, 128), 1e-3, dtype=torch.float16)    # one_hot_do: one large dO entry, the rest tiny
    do[..., 0] = 1.0
    return do, torch.full_like(do, 60000.0)


@pytest.mark.parametrize("case", ("issue15", "o_at_max", "one_hot_do"))
def test_surrogate_out_fp16_needs_many_entries(case):
    """D beyond what two fp16 entries can carry (issue 15: dO = 0.5, O ~ 1500, d = 128 gives D = 96000 and
    a two-entry surrogate clamped at 65504 lost a third of it). Any D of a real fp16 O fits: |D| <=
    max|O| * sum|dO|, so saturating the largest |dO| entries at 65504 always reaches it."""
    do, o = fp16_large_case(case)
    delta = attention_delta(do, o)
    out = surrogate_out(do, delta)
    assert torch.isfinite(out).all() and out.dtype == torch.float16
    got = _rowsum(do, out)
    assert _rel(got, delta.double()) <= 4 * 2.0**-24, _rel(got, delta.double())


def test_math_bwd_derives_delta_from_the_o_it_is_handed():
    """The math kernel keeps the fused kernels' contract (D from O): a wrong O gives wrong gradients, and a
    surrogate O gives the gradients of the real one. Without this the CPU tests cannot see the surrogate."""
    q, k, v, do = _inputs(31, 17, 17, 4, 2, 16, torch.float64)
    o, lse = block_fwd(q, k, v, mask="causal")
    want = block_bwd(do, q, k, v, o, lse, mask="causal")
    sur = block_bwd(do, q, k, v, surrogate_out(do, attention_delta(do, o)), lse, mask="causal")
    wrong = block_bwd(do, q, k, v, torch.zeros_like(o), lse, mask="causal")
    assert all(_rel(a, b) <= 1e-12 for a, b in zip(sur, want))
    assert _rel(wrong[0], want[0]) > 1e-2 and torch.equal(wrong[2], want[2])      # dV does not read D


# ------------------------------------------------------------------------------------------- 7. select_backend
@pytest.mark.parametrize("dtype", (torch.float64, torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("d", (16, 24, 64, 7, 512))
def test_cpu_default_backend_is_math(dtype, d):
    assert select_backend(torch.device("cpu"), dtype, d) == "math"
    assert select_backend(torch.device("cpu"), dtype, d, "math") == "math"


def test_cpu_default_runs_math():
    q, k, v, do = _inputs(14, 9, 9, 4, 2, 16, torch.float32)
    o, lse = block_fwd(q, k, v, mask="causal")
    o_m, lse_m = block_fwd(q, k, v, mask="causal", backend="math")
    assert torch.equal(o, o_m) and torch.equal(lse, lse_m)
    for a, b in zip(block_bwd(do, q, k, v, o, lse, mask="causal"),
                    block_bwd(do, q, k, v, o, lse, mask="causal", backend="math")):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=["bf16", "fp32"])
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "math"])
def test_fused_backend_on_cpu_raises(backend, dtype):
    q, k, v, do = _inputs(15, 8, 8, 4, 2, 64, dtype)
    with pytest.raises(ValueError, match="backend"):
        select_backend(q.device, dtype, 64, backend)
    with pytest.raises(ValueError, match="backend"):
        block_fwd(q, k, v, backend=backend)
    o, lse = block_fwd(q, k, v)
    with pytest.raises(ValueError, match="backend"):
        block_bwd(do, q, k, v, o, lse, backend=backend)


@pytest.mark.parametrize("backend", ("bogus", "Math", "", "sdpa"))
def test_unknown_backend_raises(backend):
    q, k, v, do = _inputs(16, 8, 8, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="backend"):
        select_backend(q.device, q.dtype, 16, backend)
    with pytest.raises(ValueError, match="backend"):
        block_fwd(q, k, v, backend=backend)
    o, lse = block_fwd(q, k, v)
    with pytest.raises(ValueError, match="backend"):
        block_bwd(do, q, k, v, o, lse, backend=backend)


@pytest.mark.parametrize("mask", ("sliding", "Causal", "", None, "full"))
def test_unknown_mask_raises(mask):
    q, k, v, do = _inputs(17, 8, 8, 4, 2, 16, torch.float32)
    o, lse = block_fwd(q, k, v)
    with pytest.raises(ValueError, match="mask"):
        block_fwd(q, k, v, mask=mask)
    with pytest.raises(ValueError, match="mask"):
        block_bwd(do, q, k, v, o, lse, mask=mask)


@pytest.mark.parametrize("mask", ("causal", "causal_strict"))
@pytest.mark.parametrize("sq,sk", ((8, 12), (12, 8), (1, 2), (0, 3)))
def test_causal_needs_square_block(mask, sq, sk):
    q, k, v, do = _inputs(18, sq, sk, 4, 2, 16, torch.float32)
    o, lse = block_fwd(q, k, v)                                        # "none" is fine
    with pytest.raises(ValueError, match="mask"):
        block_fwd(q, k, v, mask=mask)
    with pytest.raises(ValueError, match="mask"):
        block_bwd(do, q, k, v, o, lse, mask=mask)


def test_bad_shapes_raise():
    q, k, v, _ = _inputs(19, 8, 8, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError):
        block_fwd(q, torch.randn(2, 8, 3, 16), torch.randn(2, 8, 3, 16))      # 4 heads over 3 kv heads
    with pytest.raises(ValueError):
        block_fwd(q, k, v[:, :7])


# ------------------------------------------------------------------------------------------- 8. fused on GPU
GPU_SHAPES = [(mask, 256, 256) for mask in MASKS] + [("none", 128, 384)]
GPU_CASES = list(itertools.product(("cudnn", "flash"), GPU_SHAPES, HEADS, (64, 128)))


@needs_cuda
@pytest.mark.parametrize("backend,shape,heads,d", GPU_CASES,
                         ids=[f"{b}-{m}-{a}x{c}-{h}/{hk}-d{d}" for b, (m, a, c), (h, hk), d in GPU_CASES])
def test_fused_matches_reference_on_gpu(backend, shape, heads, d):
    mask, sq, sk = shape
    (h, hk), dtype = heads, torch.bfloat16
    q, k, v, do = _inputs(21 + d + h * hk, sq, sk, h, hk, d, dtype, device="cuda")
    ref = _reference(q, k, v, do, mask)
    # The bar: the math kernel on the same bf16 inputs, outputs rounded to bf16 as the fused kernels return them.
    o_m, lse_m = block_fwd(q, k, v, mask=mask, backend="math")
    g_m = block_bwd(do, q, k, v, o_m, lse_m, mask=mask, backend="math")
    bar = {n: 2 * _rel_l2(x.to(dtype), ref[n]) + 1e-3 for n, x in zip(("o",) + GRADS, (o_m,) + g_m)}

    o, lse = block_fwd(q, k, v, mask=mask, backend=backend)
    assert o.dtype == dtype and o.shape == q.shape and lse.dtype == torch.float32 and lse.shape == (BATCH, h, sq)
    assert _lse_err(lse, ref["lse"]) <= 1e-3
    g_o = block_bwd(do, q, k, v, o, lse, mask=mask, backend=backend)
    g_d = block_bwd(do, q, k, v, None, lse, mask=mask, backend=backend, delta=attention_delta(do, o))
    bad = []
    for tag, got in (("fwd", {"o": o}), ("bwd(o)", dict(zip(GRADS, g_o))), ("bwd(delta)", dict(zip(GRADS, g_d)))):
        for n, x in got.items():
            if x.shape != ref[n].shape or not torch.isfinite(x).all():
                bad.append(f"{tag} {n}: shape {tuple(x.shape)} or non-finite values")
                continue
            err = _rel_l2(x, ref[n])
            if not err <= bar[n]:
                bad.append(f"{tag} {n}: rel err {err:.3g} > {bar[n]:.3g}")
    if mask == "causal_strict":
        assert (o[:, 0] == 0).all() and (g_o[0][:, 0] == 0).all() and (g_d[0][:, 0] == 0).all()
    assert not bad, "\n".join(bad)


@needs_cuda
def test_gpu_default_backend_is_fused():
    assert select_backend(torch.device("cuda"), torch.bfloat16, 128) in ("cudnn", "flash", "flash_attn")
    assert select_backend(torch.device("cuda"), torch.float32, 128) == "math"


@needs_cuda
@pytest.mark.parametrize("mask", ("none", "causal"))
@pytest.mark.parametrize("which", ("do", "o", "q,k,v,do", "q,k,v,do,o"))
@pytest.mark.parametrize("how", ("sbhd", "padded"))
@pytest.mark.parametrize("backend", ("cudnn", "flash"))
def test_fused_strided_inputs_on_gpu(backend, how, which, mask):
    """Megatron hands over [s, b, h, d] storage and autograd may hand over any dO layout: the fused kernels
    must give the grads of the contiguous run whatever the strides of q, k, v, o and dO."""
    q, k, v, do = _inputs(30, 256, 256, 8, 2, 64, torch.bfloat16, device="cuda")
    o, lse = block_fwd(q, k, v, mask=mask, backend=backend)
    ref = block_bwd(do, q, k, v, o, lse, mask=mask, backend=backend)
    t = {"q": q, "k": k, "v": v, "do": do, "o": o}
    for n in which.split(","):
        t[n] = _strided(t[n], how)
    o2, lse2 = block_fwd(t["q"], t["k"], t["v"], mask=mask, backend=backend)
    assert _rel_l2(o2, o.double()) <= 1e-3 and (lse2 - lse).abs().max().item() <= 1e-3
    got = block_bwd(t["do"], t["q"], t["k"], t["v"], t["o"], lse, mask=mask, backend=backend)
    errs = {n: _rel_l2(g, r.double()) for n, g, r in zip(GRADS, got, ref)}
    assert all(e <= 1e-3 for e in errs.values()), f"rel err vs the contiguous run: {errs}"


def _large_inputs(dtype, device="cuda"):
    """Issue 15's input: b = 1, s = 512, h = 2, d = 128, q, k ~ N(0, 1), v ~ 1500 + N(0, 1), dO = 0.5: fp16
    D = rowsum(dO * O) = 96000 > 65504, and dP - D cancels five digits."""
    q, k, v, do = _inputs(15, 512, 512, 2, 2, 128, torch.float32, device=device, b=1)
    return q.to(dtype), k.to(dtype), (v + 1500).to(dtype), torch.full_like(do, 0.5).to(dtype)


@needs_cuda
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=["fp16", "bf16"])
@pytest.mark.parametrize("backend", ("cudnn", "flash"))
def test_fused_large_activations_on_gpu(backend, dtype):
    """The backward from a surrogate O (what burst and Attention2D hand the kernel) equals the backward from
    the real O, and ours is the library's own: its error against fp64 is that of torch's public SDPA on the
    same backend (large for dq and dk here: every kernel forms D from the O rounded to 16 bits)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415 (GPU-only test)

    q, k, v, do = _large_inputs(dtype)
    ref = _reference(q, k, v, do, "causal")
    o, lse = block_fwd(q, k, v, mask="causal", backend=backend)
    g_o = block_bwd(do, q, k, v, o, lse, mask="causal", backend=backend)
    g_d = block_bwd(do, q, k, v, None, lse, mask="causal", backend=backend, delta=attention_delta(do, o))
    which = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([which]):
        ot = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        g_t = torch.autograd.grad(ot, (qt, kt, vt), do.transpose(1, 2))
    bad = []
    for n, a, b, t in zip(GRADS, g_o, g_d, g_t):
        # The two D differ only by fp32 summation order (~1e-2 after the cancellation); a clamped one by 1e3.
        same, err, lib = _rel_l2(b, a.double()), _rel_l2(a, ref[n]), _rel_l2(t.transpose(1, 2), ref[n])
        if not (torch.isfinite(b).all() and same <= 5e-2 and err <= 2 * lib + 1e-3):
            bad.append(f"{n}: surrogate vs real O {same:.3g}, error {err:.3g}, torch SDPA's {lib:.3g}")
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------------------------------- the benchmark
def test_local_attn_bench_need_arithmetic():
    """One length's need on one device (32 heads of 128, bf16): 1M tokens' q, k, v, dO (32 GiB) and one kernel's
    fwd+bwd (o, dq, dk, dv 32 GiB, cuDNN's fp32 dQ accumulator 16) do not fit 80 GiB; 64k's 5.5 GiB do."""
    from megatron_cp_plugin.bench.local_attn import need

    GiB = 2**30
    assert need(2**20, 32, 32, 128, 2) > 85 * GiB and need(2**16, 32, 32, 128, 2) < 6 * GiB
    assert need(2**16, 32, 8, 128, 2) < need(2**16, 32, 32, 128, 2)             # GQA: smaller k, v


def test_local_attn_bench_skips_a_length_that_does_not_fit(tmp_path, monkeypatch, capsys):
    """With free memory between what 64 and 1024 tokens need, 64 runs (math on CPU; the GPU's backends there) and
    1024 is one not-run row, decided before its tensors exist."""
    import json

    from megatron_cp_plugin.bench import _common, local_attn

    small, big = (local_attn.need(s, 2, 2, 16, 2) for s in (64, 1024))
    monkeypatch.setattr(_common, "free_bytes", lambda device: (small + big) / 2)
    local_attn.main(["--seq", "64", "1024", "--heads", "2", "--head-dim", "16", "--masks", "causal",
                     "--out", str(tmp_path / "la")])
    assert capsys.readouterr().out.count("not run: needs") == 2                     # the line and the table
    rows = json.loads((tmp_path / "la.json").read_text())["rows"]
    ran = {(r["S"], r.get("backend")) for r in rows if "fwd_ms" in r}
    assert {s for s, _ in ran} == {64} and (64, "merge_") in ran                 # every backend the device has
    assert (64, "math") in ran or torch.cuda.is_available()
    assert [r["S"] for r in rows if "not_run" in r] == [1024]
