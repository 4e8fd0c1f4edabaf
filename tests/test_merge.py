"""The fp32 accumulation kernel (kernels/merge.py `accumulate_`) against torch's `acc.add_` / `acc.copy_`, which
it must equal bit for bit (the same single rounding of the same sum), and the fused (o, lse) merge (`merge_`)
against its PyTorch form `merge_reference_` and the fp64 definition; on CPU through Triton's interpreter
(TRITON_INTERPRET=1, set in conftest), on GPUs compiled.
"""
from __future__ import annotations

import pytest
import torch

from megatron_cp_plugin.kernels import merge as M
from megatron_cp_plugin.kernels.flash_decode import available

from .test_local_attn import needs_cuda

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = dict(rtol=1e-5, atol=1e-5)
pytestmark = pytest.mark.skipif(not available(DEV),
                                reason="SKIPPED LOUDLY: triton is not installed (pip install triton), so the "
                                       "accumulation kernel cannot run here, not even interpreted")


@pytest.fixture(autouse=True)
def interpreted_on_cpu(monkeypatch):
    """On CPUs the kernels run only where asked (the rest of the suite runs the references): here, always."""
    monkeypatch.setattr(M, "INTERPRET_CPU", True)
    monkeypatch.setattr(M, "ACCUMULATE_MIN_NUMEL", 0)


def _spy(monkeypatch, kernel: str) -> list:
    """The grids the module's Triton kernel `kernel` is launched with from now on (it still runs)."""
    launched, real = [], getattr(M, kernel)

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]
    monkeypatch.setattr(M, kernel, Spy())
    return launched


@pytest.fixture
def acc_launches(monkeypatch):
    """The grids accumulate_ launched its kernel with: a test that expects the kernel checks it ran."""
    return _spy(monkeypatch, "_accumulate_kernel")


@pytest.fixture
def merge_launches(monkeypatch):
    """The grids merge_ launched its kernel with."""
    return _spy(monkeypatch, "_merge_kernel")


def _partials(g, b, s, h, d, blk_dtype, empty_rows=()):
    """(o, lse) fp32 and a block (o_blk in blk_dtype, lse_blk fp32); rows in empty_rows (s indices) have seen no
    key on both sides (lse -inf, o 0), row 1 none in (o, lse) only, row 2 none in the block only."""
    o, o_blk = torch.randn(b, s, h, d, generator=g), torch.randn(b, s, h, d, generator=g).to(blk_dtype)
    lse, lse_blk = torch.randn(b, h, s, generator=g) * 4, torch.randn(b, h, s, generator=g) * 4
    lse[:, :, 1], o[:, 1] = float("-inf"), 0.0
    lse_blk[:, :, 2], o_blk[:, 2] = float("-inf"), 0.0
    for r in empty_rows:
        lse[:, :, r] = lse_blk[:, :, r] = float("-inf")
        o[:, r], o_blk[:, r] = 0.0, 0.0
    return o.to(DEV), lse.to(DEV), o_blk.to(DEV), lse_blk.to(DEV)


def _merged_fp64(o, lse, o_blk, lse_blk):
    """The definition: lse = log(e^lse + e^lse_blk), o = o e^(lse - lse') + o_blk e^(lse_blk - lse'), rows that saw
    no key 0."""
    o, lse, o_blk, lse_blk = (t.double() for t in (o, lse, o_blk, lse_blk))
    new = torch.logaddexp(lse, lse_blk)
    f = M.finite_lse(new)
    w1, w2 = ((x - f).exp().transpose(1, 2).unsqueeze(-1) for x in (lse, lse_blk))
    return torch.nan_to_num(o * w1 + o_blk * w2), new


@pytest.mark.parametrize("blk_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [96, 128])
def test_merge_equals_reference_and_definition(merge_launches, blk_dtype, d):
    """Into row slices of a longer (o, lse), as the ring merges a zigzag half: the kernel equals the PyTorch form to
    fp32 rounding and the fp64 definition to fp32 accuracy, -inf rows included, nothing outside the slice written."""
    g = torch.Generator().manual_seed(d)
    o, lse, o_blk, lse_blk = _partials(g, 2, 20, 4, d, blk_dtype, empty_rows=(5,))
    rows = slice(3, 11)
    ob, lb = o_blk[:, rows].contiguous(), lse_blk[:, :, rows].contiguous()
    want_o, want_lse = o.clone(), lse.clone()
    M.merge_reference_(want_o[:, rows], want_lse[:, :, rows], ob, lb)
    exact_o, exact_lse = _merged_fp64(o[:, rows], lse[:, :, rows], ob, lb)
    M.merge_(o[:, rows], lse[:, :, rows], ob, lb)
    assert len(merge_launches) == 1
    torch.testing.assert_close(o, want_o, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lse, want_lse, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(o[:, rows].double(), exact_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[:, :, rows].double(), exact_lse, rtol=1e-6, atol=1e-6)
    assert torch.isinf(lse[:, :, 5]).all() and (o[:, 5] == 0).all(), "a row that saw no key stays empty"
    assert torch.equal(o[:, :3], want_o[:, :3]) and torch.equal(lse[:, :, 11:], want_lse[:, :, 11:])


def test_merge_many_programs_wide_rows_and_strided_block(merge_launches, monkeypatch):
    """The GPU's tiling under the interpreter: 2-row programs (rows are (b, s, h), one program's rows span several
    s), rows of 1500 in 1024-wide steps (one program loops over d), a permuted o_blk and a transposed lse_blk."""
    monkeypatch.setattr(M, "_TILE_INTERPRET", 256)
    monkeypatch.setattr(M, "_TILE", 256)
    for b, s, h, d in ((2, 9, 3, 64), (1, 3, 2, 1500)):
        g = torch.Generator().manual_seed(d)
        o, lse, o_blk, lse_blk = _partials(g, b, s, h, d, torch.bfloat16)
        o_blk = o_blk.transpose(1, 2).contiguous().transpose(1, 2)              # [b, s, h, d] with h outer
        lse_blk = lse_blk.transpose(1, 2).contiguous().transpose(1, 2)          # [b, h, s] with s outer
        want_o, want_lse = o.clone(), lse.clone()
        M.merge_reference_(want_o, want_lse, o_blk, lse_blk)
        M.merge_(o, lse, o_blk, lse_blk)
        torch.testing.assert_close(o, want_o, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(lse, want_lse, rtol=2e-6, atol=2e-6)
    assert len(merge_launches) == 2 and all(grid[0] > 1 for grid in merge_launches)


def test_merge_falls_back_to_torch(merge_launches):
    """fp64 accumulators (the CPU tests' exactness runs) and tensors autograd must see take the PyTorch form."""
    g = torch.Generator().manual_seed(1)
    o, lse, o_blk, lse_blk = (t.double() for t in _partials(g, 1, 4, 2, 8, torch.float32))
    want_o, want_lse = _merged_fp64(o, lse, o_blk, lse_blk)
    M.merge_(o, lse, o_blk, lse_blk)
    torch.testing.assert_close(o, want_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    o32, lse32, ob, lb = _partials(g, 1, 4, 2, 8, torch.float32)
    M.merge_(o32, lse32, ob.requires_grad_(), lb)
    assert merge_launches == []


@pytest.fixture
def many_launches(monkeypatch):
    return _spy(monkeypatch, "_merge_many_kernel")


@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("m", [1, 3])
def test_merge_many_equals_reference_and_one_at_a_time(many_launches, first, m, monkeypatch):
    """m partials at once into rows 1: of a longer (o, lse) (Attention2D-O's strict-causal blocks), 2-row programs and
    d = 96 in one 64-wide step plus a partial one: equal to its PyTorch form and, in fp64, to m single merges; rows no
    partial saw stay empty, and with first=True what (o, lse) held does not count."""
    monkeypatch.setattr(M, "_TILE_INTERPRET", 128)
    monkeypatch.setattr(M, "_TILE", 128)
    g = torch.Generator().manual_seed(10 * m + first)
    o, lse, _, _ = _partials(g, 2, 9, 3, 96, torch.float32, empty_rows=(4,))
    parts = [_partials(g, 2, 8, 3, 96, torch.bfloat16, empty_rows=(3,)) for _ in range(m)]
    o_blks = torch.stack([p[2] for p in parts])
    lse_blks = torch.stack([p[3] for p in parts])
    lse[:, :, 4] = float("-inf")                          # row 4 (row 3 of the slice): empty everywhere
    o[:, 4] = 0.0
    want_o, want_lse = o.clone(), lse.clone()
    M.merge_many_reference_(want_o[:, 1:], want_lse[:, :, 1:], o_blks, lse_blks, first)
    exact_o, exact_lse = o[:, 1:].double(), lse[:, :, 1:].double()
    for i in range(m):
        if first and i == 0:
            exact_o, exact_lse = o_blks[0].double().clone(), lse_blks[0].double().clone()
            continue
        exact_o, exact_lse = _merged_fp64(exact_o, exact_lse, o_blks[i], lse_blks[i])
    M.merge_many_(o[:, 1:], lse[:, :, 1:], o_blks, lse_blks, first=first)
    assert len(many_launches) == 1 and many_launches[0][0] > 1
    torch.testing.assert_close(o, want_o, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lse, want_lse, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(o[:, 1:].double(), exact_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[:, :, 1:].double(), exact_lse, rtol=1e-6, atol=1e-6)
    assert torch.isinf(lse[:, :, 4]).all() and (o[:, 4] == 0).all()
    assert torch.equal(o[:, 0], want_o[:, 0]) and torch.equal(lse[:, :, 0], want_lse[:, :, 0])


def test_merge_many_reference_in_fp64_and_fallback(many_launches):
    """fp64 (the CPU exactness runs) takes the PyTorch form, which is the definition."""
    g = torch.Generator().manual_seed(2)
    o, lse, _, _ = (t.double() for t in _partials(g, 1, 5, 2, 8, torch.float32))
    parts = [_partials(g, 1, 5, 2, 8, torch.float32) for _ in range(2)]
    o_blks, lse_blks = torch.stack([p[2] for p in parts]).double(), torch.stack([p[3] for p in parts])
    want_o, want_lse = _merged_fp64(*_merged_fp64(o, lse, o_blks[0], lse_blks[0]), o_blks[1], lse_blks[1])
    M.merge_many_(o, lse, o_blks, lse_blks)
    torch.testing.assert_close(o, want_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    assert many_launches == []


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


def test_many_programs_and_partial_tiles(acc_launches, monkeypatch):
    # The GPU's tiling under the interpreter (which otherwise runs a small problem as one program): 2-row
    # programs and, for rows of 1500, 1024-wide blocks with a partial last one.
    monkeypatch.setattr(M, "_TILE_INTERPRET", 256)
    monkeypatch.setattr(M, "_TILE", 256)
    for shape, sl in (((2, 9, 3, 64), slice(2, 7)), ((3, 5, 1500), slice(1, 4))):
        full = torch.randn(shape).to(DEV)
        x = torch.randn(full[:, sl].shape).to(DEV, torch.bfloat16)
        want = full.clone()
        want[:, sl].add_(x)
        M.accumulate_(full[:, sl], x)
        assert torch.equal(full, want)
    assert len(acc_launches) == 2 and all(grid[0] > 1 for grid in acc_launches)


def test_row_sum_sets_each_row_once():
    """A new accumulator from row blocks (burst's dK, dV, dQ at a ring step): rows set by their first block, later
    blocks added, rows no block covers zero; bit for bit torch's zeros + add_; a lone full fp32 block is adopted."""
    g = torch.Generator().manual_seed(3)
    half, shape = slice(0, 3), (2, 6, 4, 8)
    a, b, c = (torch.randn(2, 3, 4, 8, generator=g).to(DEV, torch.bfloat16) for _ in range(3))
    for blocks in ([(slice(3, None), a)], [(half, a), (slice(3, None), b), (slice(3, None), c)], [(half, a)]):
        want = torch.zeros(shape, device=DEV)
        for rows, x in blocks:
            want[:, rows].add_(x)
        assert torch.equal(M.row_sum(blocks, shape, torch.float32), want)
    full = torch.randn(shape, generator=g).to(DEV)
    assert M.row_sum([(slice(None), full)], shape, torch.float32) is full
    assert torch.equal(M.row_sum([(slice(None), full.to(torch.bfloat16))], shape, torch.float32),
                       full.to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="equal or disjoint"):
        M.row_sum([(slice(None), full), (half, a)], shape, torch.float32)


@needs_cuda
@pytest.mark.parametrize("copy", [False, True])
def test_gpu_compiled_kernel_at_ring_sizes(copy):
    """Compiled on a GPU at ring blocks' sizes (2k and 8k rows, 32 heads, d = 128: 8M and 33M elements, the
    second above ACCUMULATE_MIN_NUMEL as the runs use it), into row slices of a b = 2 accumulator, bit for bit."""
    for rows in (2048, 8192):
        full = torch.randn(2, 2 * rows, 32, 128, device="cuda")
        g = torch.randn(2, rows, 32, 128, device="cuda", dtype=torch.bfloat16)
        want = full.clone()
        (want[:, 1000:1000 + rows].copy_ if copy else want[:, 1000:1000 + rows].add_)(g)
        M.accumulate_(full[:, 1000:1000 + rows], g, copy=copy)
        assert torch.equal(full, want)


@needs_cuda
def test_gpu_compiled_merge_at_ring_sizes():
    """Compiled on a GPU at a ring block's sizes (2 x 2048 and 8192 rows, 32 heads, d = 128, where an earlier fused
    merge gave ~1 % of rows another row's weight), into zigzag-half row slices: every row against the PyTorch form."""
    torch.manual_seed(0)
    for rows in (2048, 8192):
        o = torch.randn(2, 2 * rows, 32, 128, device="cuda")
        lse = torch.randn(2, 32, 2 * rows, device="cuda") * 4
        o_blk = torch.randn(2, rows, 32, 128, device="cuda", dtype=torch.bfloat16)
        lse_blk = torch.randn(2, 32, rows, device="cuda") * 4
        want_o, want_lse = o.clone(), lse.clone()
        M.merge_reference_(want_o[:, rows:], want_lse[:, :, rows:], o_blk, lse_blk)
        M.merge_(o[:, rows:], lse[:, :, rows:], o_blk, lse_blk)
        torch.testing.assert_close(o, want_o, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(lse, want_lse, rtol=2e-6, atol=2e-6)


@needs_cuda
def test_gpu_compiled_merge_many_at_block_sizes():
    """Compiled: 4 partials of 2048 rows x 32 heads x 128 into a row slice, every row against the PyTorch form."""
    torch.manual_seed(1)
    o = torch.randn(1, 4096, 32, 128, device="cuda")
    lse = torch.randn(1, 32, 4096, device="cuda") * 4
    o_blks = torch.randn(4, 1, 2047, 32, 128, device="cuda", dtype=torch.bfloat16)
    lse_blks = torch.randn(4, 1, 32, 2047, device="cuda") * 4
    for first in (False, True):
        a_o, a_l, b_o, b_l = o.clone(), lse.clone(), o.clone(), lse.clone()
        M.merge_many_reference_(a_o[:, 1:2048], a_l[:, :, 1:2048], o_blks, lse_blks, first)
        M.merge_many_(b_o[:, 1:2048], b_l[:, :, 1:2048], o_blks, lse_blks, first)
        torch.testing.assert_close(b_o, a_o, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(b_l, a_l, rtol=2e-6, atol=2e-6)
