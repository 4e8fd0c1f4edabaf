"""The fused (o, lse) merge and fp32 accumulation kernels (kernels/merge.py) against their plain-PyTorch
definitions (`merge_reference_`, `acc.add_` / `acc.copy_`); on CPU through Triton's interpreter (TRITON_INTERPRET=1,
set in conftest), on GPUs the compiled kernels.

Tolerance of the merge: |kernel - reference| <= 1e-5 (absolute and relative), about 16 fp32 ulps at the
magnitudes here (|o| <~ 5, |lse| <~ 20, so an ulp <= 2e-6). Both evaluate the same exact formula in fp32, in a
different order (one exp for the weight and the new lse, a stable sigmoid, log1p by Goldberg's identity), and on a
GPU Triton's exp / log are ex2.approx / lg2.approx (a few ulps): their results differ by fp32 rounding only.
A wrong weight, -inf guard or lse formula moves them by 1e-2 or more. Where the result is exact by definition
(weight 0 or 1: a side with lse = -inf) both must be bit-equal. accumulate_ forms the same single rounding of
the same sum as torch's add_, so it must be bit-equal everywhere.
"""
from __future__ import annotations

import pytest
import torch

from megatron_cp_plugin.kernels import merge as M
from megatron_cp_plugin.kernels.flash_decode import available

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = dict(rtol=1e-5, atol=1e-5)
INF = float("-inf")
pytestmark = pytest.mark.skipif(not available(DEV),
                                reason="SKIPPED LOUDLY: triton is not installed (pip install triton), so the "
                                       "merge kernels cannot run here, not even interpreted")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: run on the device machine")


@pytest.fixture(autouse=True)
def interpreted_on_cpu(monkeypatch):
    """On CPUs the kernels run only where asked (the rest of the suite runs the references): here, always."""
    monkeypatch.setattr(M, "INTERPRET_CPU", True)
    monkeypatch.setattr(M, "ACCUMULATE_MIN_NUMEL", 0)


@pytest.fixture
def kernel_only(monkeypatch):
    """The reference (for comparison), with merge_'s own fallback to it disabled: merge_ must run the kernel."""
    ref = M.merge_reference_

    def refuse(*a):
        raise AssertionError("merge_ fell back to merge_reference_ where the kernel should run")
    monkeypatch.setattr(M, "merge_reference_", refuse)
    return ref


def _merge_data(b, s, h, d, blk_dtype, seed, *, view, strided_blk, dev=DEV):
    """(o, lse, o_blk, lse_blk, o_full, lse_full): o, lse views o_full[:, 3:3 + s], lse_full[:, :, 3:3 + s] when
    `view`; about a fifth of the rows -inf in lse, in lse_blk, so a few in both, and at least one of each kind."""
    g = torch.Generator().manual_seed(seed)
    pad = 8 if view else 0
    o_full = torch.randn(b, s + pad, h, d, generator=g)
    lse_full = torch.randn(b, h, s + pad, generator=g) * 5
    lse_full[torch.rand(lse_full.shape, generator=g) < 0.2] = INF
    o_blk = torch.randn(b, s, h, d, generator=g) * 2
    lse_blk = torch.randn(b, h, s, generator=g) * 5 + 1
    lse_blk[torch.rand(lse_blk.shape, generator=g) < 0.2] = INF
    o_blk, lse_blk = o_blk.to(dev, blk_dtype), lse_blk.to(dev)
    o_full, lse_full = o_full.to(dev), lse_full.to(dev)
    o, lse = (o_full[:, 3:3 + s], lse_full[:, :, 3:3 + s]) if view else (o_full, lse_full)
    lse[0, 0, 0], lse_blk[0, 0, 0] = INF, INF           # both -inf
    lse[0, 0, 1], lse_blk[0, 0, 1] = INF, 2.0            # only the old side
    lse[0, 0, 2], lse_blk[0, 0, 2] = 1.5, INF            # only the block
    lse[0, 0, 3], lse_blk[0, 0, 3] = 30.0, -30.0         # far apart: weights near 0 and 1, not equal
    lse[0, 0, 4], lse_blk[0, 0, 4] = 3.0, 3.0            # weight 1/2
    if strided_blk:                                      # o_blk [b, h, s, d] and lse_blk [b, s, h] transposed
        o_blk = o_blk.transpose(1, 2).contiguous().transpose(1, 2)
        lse_blk = lse_blk.transpose(1, 2).contiguous().transpose(1, 2)
        assert not o_blk.is_contiguous() and not lse_blk.is_contiguous()
    return o, lse, o_blk, lse_blk, o_full, lse_full


def _check_merge(ref, o, lse, o_blk, lse_blk, o_full, lse_full, tol=TOL):
    o_full0, lse_full0 = o_full.clone(), lse_full.clone()
    o_r, lse_r = o.clone(), lse.clone()
    o0, lse0 = o.clone(), lse.clone()
    ref(o_r, lse_r, o_blk, lse_blk)
    M.merge_(o, lse, o_blk, lse_blk)
    assert torch.isfinite(o).all()
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_r)), "the -inf rows of lse must be those of the reference"
    assert not torch.isnan(lse).any() and not (lse == float("inf")).any()
    torch.testing.assert_close(o, o_r, **tol)
    fin = torch.isfinite(lse_r)
    torch.testing.assert_close(lse[fin], lse_r[fin], **tol)
    # Exact cases, rows [b, s, h]: block side -inf -> unchanged; old side -inf (block not) -> the block.
    rows_lse, rows_blk = lse0.transpose(1, 2), lse_blk.transpose(1, 2)
    keep = torch.isinf(rows_blk)
    take = torch.isinf(rows_lse) & ~keep
    assert torch.equal(o[keep], o0[keep]) and torch.equal(lse.transpose(1, 2)[keep], rows_lse[keep])
    assert torch.equal(o[take], o_blk.float()[take]) and torch.equal(lse.transpose(1, 2)[take], rows_blk[take].float())
    # Nothing outside the views written.
    if o.data_ptr() != o_full.data_ptr() or o.shape != o_full.shape:
        o_full0[:, 3:3 + o.shape[1]], lse_full0[:, :, 3:3 + o.shape[1]] = o, lse
        assert torch.equal(o_full, o_full0) and torch.equal(lse_full, lse_full0)


@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("blk_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("view", [False, True])
def test_merge_matches_reference(kernel_only, d, blk_dtype, view):
    b = 2 if view else 1                 # b = 2: o[:, 3:11] is non-contiguous along dim 0
    data = _merge_data(b, 8, 3, d, blk_dtype, seed=d + view, view=view, strided_blk=False)
    _check_merge(kernel_only, *data)


@pytest.mark.parametrize("blk_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_merge_strided_block_and_lse(kernel_only, blk_dtype):
    _check_merge(kernel_only, *_merge_data(2, 11, 4, 64, blk_dtype, seed=7, view=True, strided_blk=True))


def test_merge_repeated_from_empty(kernel_only):
    # The ring's use: start from (0, -inf) rows, merge blocks in turn; every step equals the reference's.
    g = torch.Generator().manual_seed(3)
    b, s, h, d = 2, 9, 2, 96
    o, lse = torch.zeros(b, s, h, d, device=DEV), torch.full((b, h, s), INF, device=DEV)
    o_r, lse_r = o.clone(), lse.clone()
    for step in range(4):
        o_blk = torch.randn(b, s, h, d, generator=g).to(DEV, torch.bfloat16)
        lse_blk = (torch.randn(b, h, s, generator=g) * 3).to(DEV)
        lse_blk[:, :, step::3] = INF                  # causal-like: some rows see nothing in a block,
        lse_blk[:, :, -1] = INF                       # the last in none
        M.merge_(o, lse, o_blk, lse_blk)
        kernel_only(o_r, lse_r, o_blk, lse_blk)
        assert torch.equal(torch.isinf(lse), torch.isinf(lse_r))
        torch.testing.assert_close(o, o_r, **TOL)
        fin = torch.isfinite(lse_r)
        torch.testing.assert_close(lse[fin], lse_r[fin], **TOL)
    assert torch.isinf(lse[:, :, -1]).all() and (o[:, -1] == 0).all() and torch.isfinite(lse[:, :, :-1]).all()


def test_many_programs_and_partial_tiles(kernel_only, acc_launches, monkeypatch):
    # The GPU's tiling under the interpreter (which otherwise runs a small problem as one program): 2 rows of
    # 128 per merge program over 2 * 3 * 7 = 42 rows; accumulate_ in 2-row programs and, for rows of 1500, in
    # 1024-wide blocks with a partial last one.
    monkeypatch.setattr(M, "_TILE_INTERPRET", 256)
    monkeypatch.setattr(M, "_TILE", 256)
    _check_merge(kernel_only, *_merge_data(2, 7, 3, 96, torch.bfloat16, seed=4, view=True, strided_blk=True))
    for shape, sl in (((2, 9, 3, 64), slice(2, 7)), ((3, 5, 1500), slice(1, 4))):
        full = torch.randn(shape).to(DEV)
        x = torch.randn(full[:, sl].shape).to(DEV, torch.bfloat16)
        want = full.clone()
        want[:, sl].add_(x)
        M.accumulate_(full[:, sl], x)
        assert torch.equal(full, want)
    assert len(acc_launches) == 2 and all(grid[0] > 1 for grid in acc_launches)


def test_merge_falls_back_to_the_reference(monkeypatch):
    class Refuse:
        def __getitem__(self, grid):
            raise AssertionError("the kernel ran where the reference should")
    monkeypatch.setattr(M, "_merge_kernel", Refuse())
    o, lse, ob, lb, *_ = _merge_data(1, 5, 2, 64, torch.float32, seed=1, view=False, strided_blk=False)
    for blk in (torch.float64, torch.float32):                          # fp64 accumulators
        o64, lse64 = o.double(), lse.double()
        M.merge_(o64, lse64, ob.to(blk), lb.to(blk))
        o_r, lse_r = o.double(), lse.double()
        M.merge_reference_(o_r, lse_r, ob.to(blk), lb.to(blk))
        assert torch.equal(o64, o_r) and torch.equal(lse64, lse_r)
    og = o.clone().requires_grad_()                                    # autograd must see it
    M.merge_(og * 1, lse.clone(), ob, lb)
    with torch.no_grad():
        monkeypatch.setattr(M, "available", lambda dev: False)        # no Triton here
        M.merge_(o, lse, ob, lb)


@pytest.fixture
def acc_launches(monkeypatch):
    """The grids accumulate_ launched its kernel with: a test that expects the kernel checks it ran."""
    launched, real = [], M._accumulate_kernel

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]
    monkeypatch.setattr(M, "_accumulate_kernel", Spy())
    return launched


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("copy", [False, True])
def test_accumulate_equals_torch(acc_launches, x_dtype, acc_dtype, copy):
    g = torch.Generator().manual_seed(5)
    full = torch.randn(2, 20, 4, 96, generator=g).to(DEV, acc_dtype)
    x = torch.randn(2, 8, 4, 96, generator=g).to(DEV, x_dtype)
    want = full.clone()
    (want[:, 3:11].copy_ if copy else want[:, 3:11].add_)(x)
    M.accumulate_(full[:, 3:11], x, copy=copy)                       # a row slice: strided along dim 0
    assert len(acc_launches) == 1
    assert torch.equal(full, want), "bit-equal to torch, and nothing outside the slice written"


def test_accumulate_rounds_once_in_the_promoted_dtype(acc_launches):
    # fp32 acc + fp64 x: torch adds in fp64 and rounds once. 1 + (2^-24 + 2^-50) rounds up to 1 + 2^-23; rounding x
    # to fp32 first (2^-24) would make a tie, rounded to even: 1.
    acc = torch.ones(4, device=DEV)
    x = torch.full((4,), 2.0 ** -24 + 2.0 ** -50, device=DEV, dtype=torch.float64)
    want = acc.clone().add_(x)
    assert (want == 1 + 2.0 ** -23).all()
    M.accumulate_(acc, x)
    assert torch.equal(acc, want) and len(acc_launches) == 1


@pytest.mark.parametrize("shape", [(2, 7, 2, 128), (3, 5, 64), (4, 33), (70,)])
def test_accumulate_shapes_and_strided_x(acc_launches, shape):
    # [b, s, h_kv, d] and fewer dims; x a permuted (non-contiguous, last dim strided) view.
    g = torch.Generator().manual_seed(len(shape))
    acc = torch.randn(shape, generator=g).to(DEV)
    x = torch.randn(tuple(reversed(shape)), generator=g).to(DEV, torch.bfloat16).permute(*reversed(range(len(shape))))
    assert x.shape == acc.shape
    want = acc.clone().add_(x)
    M.accumulate_(acc, x)
    assert torch.equal(acc, want)
    M.accumulate_(acc, x, copy=True)
    assert torch.equal(acc, x.float())
    assert len(acc_launches) == 2


def test_accumulate_falls_back_to_torch(acc_launches):
    acc = torch.zeros(3, 4, device=DEV, dtype=torch.bfloat16)            # not an fp32 / fp64 accumulator
    M.accumulate_(acc, torch.ones(3, 4, device=DEV))
    acc32 = torch.zeros(3, 4, device=DEV)
    M.accumulate_(acc32, torch.ones(4, device=DEV))                      # broadcasting: torch's add_
    xg = torch.ones(3, 4, device=DEV, requires_grad=True)
    y = torch.zeros(3, 4, device=DEV) * 1
    M.accumulate_(y, xg)                                                 # autograd must see it
    assert acc_launches == [] and (acc == 1).all() and (acc32 == 1).all() and y.grad_fn is not None


@needs_cuda
def test_gpu_compiled_kernels_at_ring_sizes():
    """The compiled kernels on a GPU at a ring block's size (2k rows, 32 heads, d = 128, bf16 block), views of a
    b = 2 accumulator, against the references."""
    o, lse, ob, lb, o_full, lse_full = _merge_data(2, 2048, 32, 128, torch.bfloat16, seed=11, view=True,
                                                   strided_blk=False, dev=torch.device("cuda"))
    _check_merge(M.merge_reference_, o, lse, ob, lb, o_full, lse_full)
    full = torch.randn(2, 4096, 8, 128, device="cuda")
    g = torch.randn(2, 2048, 8, 128, device="cuda", dtype=torch.bfloat16)
    want = full.clone()
    want[:, 1000:3048].add_(g)
    M.accumulate_(full[:, 1000:3048], g)
    assert torch.equal(full, want)
