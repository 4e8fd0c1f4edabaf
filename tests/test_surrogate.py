"""The fused surrogate-O kernel (kernels/surrogate.py) against its plain-PyTorch definition: on CPU through
Triton's interpreter (TRITON_INTERPRET=1, set in conftest), on GPUs the compiled kernel.

The property every caller relies on: rowsum(dO * out) == D to fp32, with out finite and in dO's dtype. The
kernel must meet it as well as the reference does on the same rows (its error at most twice the
reference's, plus a few fp32 ulps of D), and build the same tensor: c * sign(dO) off the top entries, within
a few ulps of the reference's (l1 is summed in another order; ties among the top |dO| may pick other entries).
"""
from __future__ import annotations

import pytest
import torch

from megatron_cp_plugin.kernels import surrogate as sg

from .test_local_attn import fp16_large_case, needs_cuda

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not sg.available(DEV),
                                reason="SKIPPED LOUDLY: triton is not installed (pip install triton), so the "
                                       "surrogate kernel cannot run here, not even interpreted")


@pytest.fixture(autouse=True)
def interpreted_on_cpu(monkeypatch):
    """On CPUs the kernels run only where asked (the rest of the suite runs the references): here, always."""
    monkeypatch.setattr(sg, "INTERPRET_CPU", True)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
EPS32 = torch.finfo(torch.float32).eps


def _kernel(do, delta):
    """The kernel with the GPU's rows per program, so that a few dozen rows make several programs and a
    partial last one even under the interpreter."""
    rpp = max(1, sg.ELEMS_PER_PROGRAM // int(2 ** (do.shape[-1] - 1).bit_length()))
    return sg.surrogate_out_triton(do, delta, rows_per_program=rpp)


def _err(do, out, delta):
    """|rowsum(dO * out) - D| per row [b, h, s], in fp64 (exact products and sums)."""
    got = (do.double() * out.double()).sum(-1).transpose(1, 2)
    return (got - delta.double()).abs()


def _floor(do):
    """fp16 turns subnormal below 2^-14: an absolute floor of a few 2^-24 * max|dO| on the error of a row
    (tests/test_local_attn.py), 0 for the other dtypes."""
    if do.dtype != torch.float16:
        return 0.0
    return 4 * 2.0**-24 * do.double().abs().amax(-1).transpose(1, 2)


def check(do, delta, out, ref=None):
    """out meets the property as well as the reference does and is the reference's construction."""
    ref = sg.surrogate_out_reference(do, delta) if ref is None else ref
    assert out.dtype == do.dtype and out.shape == do.shape and out.is_contiguous()
    assert torch.isfinite(out).all()
    e_k, e_r = _err(do, out, delta), _err(do, ref, delta)
    bound = 2 * e_r + 8 * EPS32 * delta.double().abs() + _floor(do)
    worst = (e_k - bound).max().item()
    assert worst <= 0, f"kernel error {e_k.max().item():.3g} vs reference {e_r.max().item():.3g}"
    # Off the top entries out = c * sign(dO), as the reference's to a few ulps of the dtype (c = D / l1, l1
    # summed in another order: up to ~8 fp32 ulps apart for d = 256); entries that differ more are top
    # entries of one of them: at most 6 per row, each with |dO| >= the 3rd largest.
    tol = 4 * torch.finfo(do.dtype).eps + 16 * EPS32
    far = (out.double() - ref.double()).abs() > tol * ref.double().abs()
    mag = do.double().abs()
    third = mag.topk(min(3, do.shape[-1]), -1).values[..., -1:]
    assert (far.sum(-1) <= 6).all(), f"rows with more than 6 entries off the reference: {(far.sum(-1) > 6).sum()}"
    assert not (far & (mag < third)).any(), "an entry outside the top three |dO| differs from the reference"
    return e_k


def _data(b, s, h, d, dtype, kind, seed):
    g = torch.Generator().manual_seed(seed)
    do = torch.randn(b, s, h, d, generator=g).to(dtype)
    if kind == "randn":
        delta = torch.randn(b, h, s, generator=g)
    elif kind == "scaled":                                              # magnitudes over 8 decades
        delta = torch.randn(b, h, s, generator=g) * 10.0 ** torch.randint(-4, 5, (b, h, s), generator=g)
    else:                                                               # a real D = rowsum(dO * O)
        o = torch.randn(b, s, h, d, generator=g).to(dtype)
        delta = (do.float() * o.float()).sum(-1).transpose(1, 2)
    return do.to(DEV), delta.contiguous().to(DEV)


@pytest.mark.parametrize("d", (64, 96, 128, 256))
@pytest.mark.parametrize("kind", ("randn", "scaled", "rowsum"))
@pytest.mark.parametrize("dt", DTYPES)
def test_kernel_reproduces_delta(dt, kind, d):
    dtype = DTYPES[dt]
    do, delta = _data(2, 9, 3, d, dtype, kind, seed=d + 7 * len(kind) + 100 * list(DTYPES).index(dt))  # 54 rows
    do[:, 4] = 0                                                        # rows with dO = 0 and D = 0
    delta[:, :, 4] = 0
    do[0, 2, 1] = 0                                                     # one nonzero entry
    do[0, 2, 1, d // 3] = 1.5
    do[1, 6, 2] = 0                                                     # two nonzero entries, one tie
    do[1, 6, 2, 1], do[1, 6, 2, d - 1] = -0.75, 0.75
    out = _kernel(do, delta)
    e_k = check(do, delta, out)
    assert (out[:, 4] == 0).all() and (out[0, 2, 1] != 0).sum() <= 1 and (out[1, 6, 2] != 0).sum() <= 2
    # Elsewhere D to the accuracy of fp32, not of the dtype (the reference's own test, test_local_attn).
    normal = torch.ones_like(e_k, dtype=torch.bool)
    normal[0, 1, 2] = normal[1, 2, 6] = False
    excess = ((e_k - _floor(do)).clamp_min(0) / delta.double().abs().clamp_min(1e-300))[normal]
    assert excess.max().item() <= 8 * EPS32, f"per-row rel err {excess.max().item():.3g}"


@pytest.mark.parametrize("d", (1, 2, 3, 5))
@pytest.mark.parametrize("dt", DTYPES)
def test_short_rows(dt, d):
    """d < 3 has fewer top entries than three; d = 5 is not a power of two (padding never a top entry)."""
    do, delta = _data(1, 7, 5, d, DTYPES[dt], "rowsum", seed=d)
    check(do, delta, _kernel(do, delta))


@pytest.mark.parametrize("case", ("v600", "issue15", "o_at_max", "one_hot_do"))
def test_fp16_large_delta(case):
    """fp16 rows whose D only a saturated surrogate carries (test_local_attn's cases): |D| near max|O| * sum|dO|
    with O at or near 65504; kernel finite and exact to fp32 like the reference."""
    do, o = fp16_large_case(case)
    do, o = do.to(DEV), o.to(DEV)
    delta = (do.float() * o.float()).sum(-1).transpose(1, 2).contiguous()
    out = _kernel(do, delta)
    e_k = check(do, delta, out)
    assert (e_k / delta.double().abs()).max().item() <= 4 * 2.0**-24
    if case == "o_at_max":
        assert out.abs().max().item() == 65504.0                        # saturated, not inf


@pytest.mark.parametrize("dt", DTYPES)
def test_strided_views(dt):
    """dO a [:, half:] view of a b > 1 tensor, D a slice of a wider [b, h, S] tensor (burst's
    delta_j[:, :, qs]) or a transposed [b, s, h] one: read through their strides, same result as copies."""
    dtype = DTYPES[dt]
    g = torch.Generator().manual_seed(3)
    full = torch.randn(2, 40, 3, 96, generator=g).to(dtype).to(DEV)
    do = full[:, 21:]                                                   # [2, 19, 3, 96], not contiguous
    wide = torch.randn(2, 3, 50, generator=g).to(DEV)
    d_slice = wide[:, :, 5:24]
    d_trans = torch.randn(2, 19, 3, generator=g).to(DEV).transpose(1, 2)
    assert not do.is_contiguous() and not d_slice.is_contiguous() and not d_trans.is_contiguous()
    for delta in (d_slice, d_trans):
        out = _kernel(do, delta)
        assert torch.equal(out, _kernel(do.contiguous(), delta.contiguous()))
        check(do, delta, out)
    assert torch.equal(sg.surrogate_out(do, d_slice), sg.surrogate_out(do.contiguous(), d_slice.contiguous()))


def test_dispatch(monkeypatch):
    """surrogate_out takes the kernel for fp16 / bf16 / fp32 with d <= MAX_D, the reference otherwise."""
    calls = []
    for name in ("surrogate_out_triton", "surrogate_out_reference"):
        fn = getattr(sg, name)
        monkeypatch.setattr(sg, name, lambda *a, fn=fn, name=name, **k: calls.append(name) or fn(*a, **k))
    for dtype in DTYPES.values():
        do, delta = _data(2, 5, 3, 64, dtype, "rowsum", seed=4)
        assert sg.use_kernel(do)
        out = sg.surrogate_out(do, delta)                               # the interpreter's own block size
        assert calls[-1] == "surrogate_out_triton" and torch.equal(out, _kernel(do, delta))
        check(do, delta, out)
    d64 = do.double()
    assert not sg.use_kernel(d64)
    sg.surrogate_out(d64, delta.double())
    assert calls[-1] == "surrogate_out_reference"
    wide = torch.randn(1, 2, 2, sg.MAX_D + 1, device=DEV)
    assert not sg.use_kernel(wide)
    sg.surrogate_out(wide, torch.randn(1, 2, 2, device=DEV))
    assert calls[-1] == "surrogate_out_reference"
    empty = torch.empty(2, 0, 3, 64, dtype=torch.float16, device=DEV)
    assert sg.surrogate_out(empty, torch.empty(2, 3, 0, device=DEV)).shape == empty.shape
    with pytest.raises(ValueError, match="delta"):
        sg.surrogate_out(do, delta.transpose(1, 2))


@pytest.mark.parametrize("d", (1, 2, 5, 96, 256))
@pytest.mark.parametrize("dt", DTYPES)
def test_both_selections_build_the_same_tensor(dt, d):
    """select="keys" (one max of packed int64 keys a pass) finds the entries select="argmax" finds: the outputs are
    equal bit for bit, on rows with ties among the largest |dO| (the leftmost wins), zero rows, -0.0 entries, one
    nonzero entry and padding (d not a power of two); on the GPU compiled, on CPUs interpreted."""
    dtype = DTYPES[dt]
    do, delta = _data(2, 9, 3, d, dtype, "rowsum", seed=d + 31 * list(DTYPES).index(dt))
    do[:, 4] = 0                                                        # zero rows, D = 0 and D != 0
    delta[0, :, 4] = 0
    do[0, 2, 1] = -0.0                                                  # -0.0 everywhere but one entry
    do[0, 2, 1, d // 3] = -1.5
    do[1, 6, 2] = 0.5                                                   # all tied: the leftmost three carry
    do[1, 6, 2, d - 1] = -0.5
    do[1, 7, 0, : min(d, 4)] = torch.tensor([0.25, -2.0, 2.0, -0.25])[: min(d, 4)].to(DEV, dtype)   # a tie of signs
    rpp = max(1, sg.ELEMS_PER_PROGRAM // int(2 ** (d - 1).bit_length()))
    outs = [sg.surrogate_out_triton(do, delta, rows_per_program=rpp, select=sel) for sel in sg.SELECTS]
    bits = torch.int32 if dtype == torch.float32 else torch.int16                  # -0.0 and 0.0 told apart
    assert torch.equal(outs[0].view(bits), outs[1].view(bits))
    check(do, delta, outs[1])
    with pytest.raises(ValueError, match="select"):
        sg.surrogate_out_triton(do, delta, select="topk")


@pytest.mark.parametrize("dt", DTYPES)
def test_looping_programs_build_the_same_tensor(dt):
    """A grid of fewer programs than tiles (programs_per_sm > 0: each program loops over tiles, the next one's load
    in flight) writes every row, the partial last tile included, bit for bit as a program a tile does; one "SM"
    under the interpreter, so 1-3 programs over 7 tiles here."""
    dtype = DTYPES[dt]
    do, delta = _data(1, 13, 2, 96, dtype, "rowsum", seed=5)            # 26 rows: 7 tiles of 4, the last of 2
    one = sg.surrogate_out_triton(do, delta, rows_per_program=4, programs_per_sm=0, index_bits=64)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for pps in (0, 1, 2, 3):
        for index_bits in (32, 64):
            out = sg.surrogate_out_triton(do, delta, rows_per_program=4, programs_per_sm=pps, index_bits=index_bits)
            assert torch.equal(out.view(bits), one.view(bits)), (pps, index_bits)
    check(do, delta, one)
    with pytest.raises(ValueError, match="programs_per_sm"):
        sg.surrogate_out_triton(do, delta, programs_per_sm=-1)
    with pytest.raises(ValueError, match="index_bits"):
        sg.surrogate_out_triton(do, delta, index_bits=16)


@pytest.mark.parametrize("dt", DTYPES)
def test_row_slices_build_the_same_tensor(dt):
    """A row read as slices of any width (slice_cols: the slices in a thread's registers, a few threads a slice) gets
    the same top entries as whole rows: bit for bit in 16-bit dtypes (l1 = sum|dO| is summed in another order, which
    the 16-bit c hides on these rows), and the property and the construction in fp32, where c shows l1's last bit.
    d = 96 pads to 128: the padding columns of the last slice are never a top entry; rows with one nonzero entry, ties,
    -0.0 and all zeros cross the slices' boundaries."""
    dtype = DTYPES[dt]
    do, delta = _data(1, 11, 3, 96, dtype, "rowsum", seed=31)            # 33 rows
    do[0, 2, 1] = 0
    do[0, 2, 1, 70] = -1.5                                               # one nonzero entry, in the second slice
    do[0, 3, 0] = 0.5                                                    # all tied: the leftmost three carry
    do[0, 4, 2] = -0.0
    do[0, 5] = 0
    delta[0, :, 5] = 0
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    whole = sg.surrogate_out_triton(do, delta, rows_per_program=4, slice_cols=128)
    check(do, delta, whole)
    for w in (64, 32, 16, 8):
        for sel in sg.SELECTS:
            out = sg.surrogate_out_triton(do, delta, rows_per_program=4, slice_cols=w, select=sel)
            check(do, delta, out)
            if dtype != torch.float32:
                assert torch.equal(out.view(bits), whole.view(bits)), (w, sel)
    with pytest.raises(ValueError, match="slice_cols"):
        sg.surrogate_out_triton(do, delta, slice_cols=48)


def test_default_rows_give_every_thread_a_row():
    """The default rows a program cover one layout tile (threads / threads a slice) at every shape the kernel takes:
    fewer rows make threads hold copies of others' rows (2 warps with 4 rows of 64-column slices ran 5x slower)."""
    for d in (16, 64, 128, 256):
        for w in (8, 16, 32, 64, 128):
            for nw in (1, 2, 4, 8):
                for size in (2, 4):
                    rows = sg._default_rows(d, min(w, d), nw, size)
                    threads_a_slice = max(1, min(w, d) // (16 // size))
                    assert rows * threads_a_slice >= nw * 32 and rows * d >= sg.ELEMS_PER_PROGRAM, (d, w, nw, size)
    assert sg._default_rows(128, 64, 4, 2) == 16                         # the default launch at d = 128, bf16


def test_int32_offsets_only_where_they_fit():
    """index_bits=32 is taken only where every offset of every tensor fits in int32 with room for the tiles past the
    end; a view's offsets count by its strides, not its numel."""
    small = torch.empty(2, 8, 4, 16)
    assert sg._offsets_fit_int32(small, small[:, :, :, :4].transpose(1, 2))
    big = torch.empty_strided((2, 4), (2**31, 1), device="meta")          # 2 rows, 2**31 apart
    assert not sg._offsets_fit_int32(small, big)
    assert not sg._offsets_fit_int32(torch.empty(1).expand(2**31))       # offsets 0, numel alone too large


@needs_cuda
@pytest.mark.parametrize("d", (64, 96, 128, 256))
@pytest.mark.parametrize("dt", DTYPES)
def test_gpu_kernel_matches_reference(dt, d):
    """The compiled kernel on CUDA against the reference on the same device, through surrogate_out (which
    must pick the kernel there), on burst-like views."""
    dtype = DTYPES[dt]
    g = torch.Generator(device="cuda").manual_seed(d)
    full = torch.randn(2, 2048, 8, d, device="cuda", generator=g).to(dtype)
    o = torch.randn(2, 2048, 8, d, device="cuda", generator=g).to(dtype)
    lse = (full.float() * o.float()).sum(-1).transpose(1, 2)            # [2, 8, 2048]
    do, delta = full[:, 1024:], lse[:, :, 1024:]
    assert sg.use_kernel(do)
    out = sg.surrogate_out(do, delta)
    check(do, delta, out)
    do[:, 3] = 0
    delta[:, :, 3] = 0
    out = sg.surrogate_out(do, delta)
    check(do, delta, out)
    assert (out[:, 3] == 0).all()


@needs_cuda
@pytest.mark.parametrize("dt", DTYPES)
def test_gpu_every_launch_shape_meets_the_property(dt):
    """The launches the benchmark sweeps (`megatron-cp-bench surrogate --slice-cols 128 64 32 16 --num-warps 1 4
    --rows-per-program 4 16 --programs-per-sm 32 --index-bits 64 32`, a grid of a program a tile, and the extremes 8
    warps with 1 or 64 rows) build, compiled, a
    tensor that meets the property; int32 and int64 offsets give the same tensor bit for bit, and so do both
    selections at the default launch. Whichever launch a sweep makes the default has run here. (Launches with another
    row layout may sum l1 in another order, so they are not compared bit for bit. The full product with both
    selections compiled ~100 kernels a dtype and took 160-230 s of the GPU suite; the selections' equality on odd
    shapes is test_both_selections_build_the_same_tensor's.)"""
    dtype = DTYPES[dt]
    g = torch.Generator(device="cuda").manual_seed(11)
    do = torch.randn(1, 1000, 8, 128, device="cuda", generator=g).to(dtype)
    o = torch.randn(1, 1000, 8, 128, device="cuda", generator=g).to(dtype)
    delta = (do.float() * o.float()).sum(-1).transpose(1, 2).contiguous()
    do[0, 7] = 0
    ref = sg.surrogate_out_reference(do, delta)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    shapes = [(w, nw, rpp, 32) for w in (128, 64, 32, 16) for nw in (1, 4) for rpp in (4, 16)]
    for w, nw, rpp, pps in shapes + [(64, 2, 8, 0), (128, 8, 1, 0), (32, 8, 64, 32)]:
        outs = [sg.surrogate_out_triton(do, delta, select="keys", num_warps=nw, rows_per_program=rpp,
                                        programs_per_sm=pps, index_bits=ib, slice_cols=w) for ib in (64, 32)]
        check(do, delta, outs[0], ref)
        assert torch.equal(outs[0].view(bits), outs[1].view(bits)), (w, nw, rpp, pps)
    base, other = (sg.surrogate_out_triton(do, delta, select=sel) for sel in sg.SELECTS)
    check(do, delta, base, ref)
    assert torch.equal(base.view(bits), other.view(bits))
