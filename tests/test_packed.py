"""Packed (varlen) local kernels against the fp64 varlen reference, the strict-mask view, the padding helpers.
CPU tests run the "math" backend through the same segment bookkeeping the fused kernels get; the fused varlen
backends ("flash", "flash_attn") run only on a GPU. The algorithms are tested in test_cp_attention.py."""
from __future__ import annotations

import itertools
import zlib

import pytest
import torch

import megatron_cp_plugin as mcp
from megatron_cp_plugin.kernels.local_attn import MASKS, unsupported, block_bwd, block_fwd, select_backend
from megatron_cp_plugin.kernels.reference import attention_reference
from megatron_cp_plugin.kernels.segments import Segments, strict_view

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: run on the device machine")
HEADS = ((4, 4), (8, 2))
SEGS = {"mixed": (0, 17, 18, 18, 21, 40, 41),           # long, single-row, empty, short, long, single-row
        "one": (0, 23)}


def _inputs(seed, sq, sk, h, hk, d, dtype, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(1, n, m, d, generator=g) for n, m in ((sq, h), (sk, hk), (sk, hk), (sq, h)))
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v, do))


def _reference(q, k, v, do, mask, cu_q, cu_k=None):
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    o, lse = attention_reference(qr, kr, vr, mask=mask, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    return (o.detach(), lse.detach()) + torch.autograd.grad(o, (qr, kr, vr), do.double())


def _rel(x, ref):
    return ((x.double() - ref).abs().max() / ref.abs().max()).item()


def _rel_l2(x, ref):
    return (torch.linalg.vector_norm(x.double() - ref) / torch.linalg.vector_norm(ref)).item()


def _check(got, ref, metric, tol, what):
    o, lse, *grads = got
    assert torch.equal(torch.isinf(lse), torch.isinf(ref[1])), f"{what}: -inf lse rows differ"
    fin = torch.isfinite(ref[1])
    assert (lse[fin].double() - ref[1][fin]).abs().max() <= 10 * tol, f"{what}: lse"
    for n, x, r in zip(("o", "dq", "dk", "dv"), (o, *grads), (ref[0], *ref[2:])):
        assert torch.isfinite(x).all(), f"{what}: {n} not finite"
        err = metric(x, r)
        assert err <= tol, f"{what}: {n} rel err {err:.3g} > {tol:.3g}"


# ------------------------------------------------------------------------------------------- math vs fp64
@pytest.mark.parametrize("chunk", (1, 8, 512))
@pytest.mark.parametrize("h,hk", HEADS, ids=["mha", "gqa"])
@pytest.mark.parametrize("segs", sorted(SEGS))
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)], ids=["fp64", "fp32"])
def test_varlen_math_matches_reference(dtype, tol, mask, segs, h, hk, chunk):
    cu = SEGS[segs]
    q, k, v, do = _inputs(zlib.crc32(repr((mask, segs, h, chunk)).encode()), cu[-1], cu[-1], h, hk, 16, dtype)
    o, lse = block_fwd(q, k, v, mask=mask, backend="math", chunk_size=chunk, cu_seqlens_q=cu)
    grads = block_bwd(do, q, k, v, o, lse, mask=mask, backend="math", chunk_size=chunk, cu_seqlens_q=cu)
    _check((o, lse) + tuple(grads), _reference(q, k, v, do, mask, cu), _rel, tol, f"{mask} {segs} chunk {chunk}")


@pytest.mark.parametrize("chunk", (3, 512))
def test_varlen_noncausal_different_query_and_key_segments(chunk):
    """Query segment i sees key segment i only, whatever their lengths; a query segment whose key segment is
    empty sees nothing (o = 0, lse = -inf, no gradient)."""
    cu_q, cu_k = (0, 5, 5, 9, 12), (0, 2, 9, 9, 16)
    q, k, v, do = _inputs(3, 12, 16, 8, 2, 16, torch.float64)
    o, lse = block_fwd(q, k, v, chunk_size=chunk, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    grads = block_bwd(do, q, k, v, o, lse, chunk_size=chunk, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    ref = _reference(q, k, v, do, "none", cu_q, cu_k)
    _check((o, lse) + tuple(grads), ref, _rel, 1e-10, "q/k segments differ")
    assert torch.isinf(lse[:, :, 5:9]).all() and (o[:, 5:9] == 0).all() and (grads[0][:, 5:9] == 0).all()


@pytest.mark.parametrize("mask", MASKS)
def test_varlen_bwd_with_delta_equals_bwd_with_o(mask):
    cu = SEGS["mixed"]
    q, k, v, do = _inputs(9, cu[-1], cu[-1], 4, 2, 16, torch.float64)
    o, lse = block_fwd(q, k, v, mask=mask, cu_seqlens_q=cu)
    d = (do * o).sum(-1).transpose(1, 2)
    a = block_bwd(do, q, k, v, o, lse, mask=mask, cu_seqlens_q=cu)
    b = block_bwd(do, q, k, v, None, lse, delta=d, mask=mask, cu_seqlens_q=cu)
    assert all(_rel(x, y.double()) <= 1e-12 for x, y in zip(b, a))


def test_one_segment_equals_the_unpacked_block():
    q, k, v, do = _inputs(4, 23, 23, 4, 2, 16, torch.float64)
    for mask in MASKS:
        o1, l1 = block_fwd(q, k, v, mask=mask)
        o2, l2 = block_fwd(q, k, v, mask=mask, cu_seqlens_q=torch.tensor([0, 23], dtype=torch.int32))
        assert _rel(o2, o1.double()) <= 1e-12 and torch.equal(torch.isinf(l1), torch.isinf(l2))


# ------------------------------------------------------------------------------------------- the strict view
def test_strict_view_has_a_dummy_row_between_documents():
    """Documents [0,4) [4,6) [6,7) [7,10): view rows x = query x + 1 and key x; the dummies pair a document's
    first query with the previous document's last key."""
    view, dead = strict_view(Segments((0, 4, 6, 7, 10)))
    assert view.offsets == (0, 3, 4, 5, 6, 7, 9) and dead == (3, 5, 6)
    view, dead = strict_view(Segments((0, 0, 5, 5)))          # empty documents change nothing
    assert view.offsets == (0, 4) and dead == ()


# ------------------------------------------------------------------------------------------- errors, selection
@pytest.mark.parametrize("case,needle", [
    ("batch", "batch 1"), ("rows", "must end at sq"), ("causal_unequal", "equal query and key segments"),
    ("tensor_mask", "tensor mask"), ("bad_cu", "non-decreasing"),
])
def test_varlen_bad_input_raises(case, needle):
    q, k, v, _ = _inputs(1, 8, 8, 4, 2, 16, torch.float32)
    kw = {"cu_seqlens_q": (0, 3, 8)}
    if case == "batch":
        q, k, v = (torch.cat([t, t]) for t in (q, k, v))
    elif case == "rows":
        kw["cu_seqlens_q"] = (0, 3, 7)
    elif case == "causal_unequal":
        kw.update(mask="causal", cu_seqlens_k=(0, 4, 8))
    elif case == "tensor_mask":
        kw["mask"] = torch.ones(1, 8, 8, dtype=torch.bool)
    elif case == "bad_cu":
        kw["cu_seqlens_q"] = (0, 5, 3, 8)
    with pytest.raises(ValueError, match=needle):
        block_fwd(q, k, v, **kw)


def test_packed_backend_selection():
    assert select_backend(torch.device("cpu"), torch.bfloat16, 64, packed=True) == "math"
    assert "varlen" in unsupported("cudnn", torch.device("cuda"), torch.bfloat16, 64, packed=True)
    with pytest.raises(ValueError, match="backend='cudnn'.*varlen"):
        block_fwd(*_inputs(1, 8, 8, 4, 2, 16, torch.float32)[:3], backend="cudnn", cu_seqlens_q=(0, 8))


# ------------------------------------------------------------------------------------------- padding helpers
def test_pad_documents_places_every_token_and_pads_each_document_at_its_end():
    new, index = mcp.pad_documents(torch.tensor([0, 5, 6, 6, 14], dtype=torch.int32), 4)
    assert new.dtype == torch.int32 and new.tolist() == [0, 8, 12, 12, 20]
    assert index.tolist() == [0, 1, 2, 3, 4, 8, 12, 13, 14, 15, 16, 17, 18, 19]
    assert mcp.document_unit("ring", 4) == 8 and mcp.document_unit("attention2d-o", 4) == 4
    assert mcp.document_unit("burst", 1) == 1


def test_padding_leaves_causal_attention_of_real_tokens_unchanged():
    cu = (0, 5, 6, 13)
    q, k, v, do = _inputs(5, 13, 13, 4, 2, 16, torch.float64)
    (qp, kp, vp), new = zip(*(mcp.pad_packed(t, cu, 4, value=7.0) for t in (q, k, v)))
    _, index = mcp.pad_documents(cu, 4)
    o, _ = block_fwd(q, k, v, mask="causal", cu_seqlens_q=cu)
    op, _ = block_fwd(qp, kp, vp, mask="causal", cu_seqlens_q=new[0])
    assert new[0].tolist() == [0, 8, 12, 20] and qp.shape[1] == 20
    assert torch.equal(qp[:, index], q) and (qp[:, 5:8] == 7).all()
    assert _rel(op[:, index], o.double()) <= 1e-12
    with pytest.raises(ValueError, match="must equal cu_seqlens"):
        mcp.pad_packed(q[:, :12], cu, 4)


# ------------------------------------------------------------------------------------------- fused, on a GPU
FUSED_CASES = [(m, s) for m in MASKS for s in ("mixed", "long")] + [("none", "qk")]


@needs_cuda
@pytest.mark.parametrize("backend", ["flash", "flash_attn"])
@pytest.mark.parametrize("h,hk", HEADS, ids=["mha", "gqa"])
@pytest.mark.parametrize("mask,segs", FUSED_CASES)
def test_fused_varlen_matches_reference_on_gpu(backend, mask, segs, h, hk):
    """bf16 fused varlen kernels (one call per block) against fp64: within 2x the error of the dense kernel
    run document by document, and no worse than 2e-2."""
    if unsupported(backend, torch.device("cuda"), torch.bfloat16, 64, packed=True):
        pytest.skip(f"{backend} cannot run here")
    cu_q = cu_k = {"mixed": SEGS["mixed"], "long": (0, 1000, 1001, 1003, 2600), "qk": (0, 100, 101, 260)}[segs]
    if segs == "qk":
        cu_k = (0, 40, 40, 300)
    q, k, v, do = _inputs(11, cu_q[-1], cu_k[-1], h, hk, 64, torch.bfloat16, "cuda")
    o, lse = block_fwd(q, k, v, mask=mask, backend=backend, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    grads = block_bwd(do, q, k, v, o, lse, mask=mask, backend=backend, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    ref = _reference(q, k, v, do, mask, cu_q, cu_k)
    # The dense fused kernel per document, concatenated: what the varlen call must match in accuracy.
    per_doc = [[], [], [], []]
    for (a, b), (c, e) in zip(itertools.pairwise(cu_q), itertools.pairwise(cu_k)):
        if b == a or e == c:
            for lst, x, rows in zip(per_doc, (q, q, k, v), (b - a, b - a, e - c, e - c)):
                lst.append(torch.zeros_like(x[:, :rows]))
            continue
        od, ld = block_fwd(q[:, a:b], k[:, c:e], v[:, c:e], mask=mask, backend="flash")
        gd = block_bwd(do[:, a:b], q[:, a:b], k[:, c:e], v[:, c:e], od, ld, mask=mask, backend="flash")
        for lst, x in zip(per_doc, (od,) + tuple(gd)):
            lst.append(x)
    dense = [torch.cat(x, 1) for x in per_doc]
    assert torch.equal(torch.isinf(lse), torch.isinf(ref[1]))
    for n, x, r, dd in zip(("o", "dq", "dk", "dv"), (o,) + tuple(grads), (ref[0],) + ref[2:], dense):
        err, bar = _rel_l2(x, r), max(2 * _rel_l2(dd, r), 1e-3)
        assert err <= min(bar, 2e-2), f"{backend} {mask} {segs}: {n} rel err {err:.3g} (dense per doc {bar / 2:.3g})"


# ------------------------------------------------------------------------------------------- the benchmark
def test_packed_bench_on_gloo(tmp_path):
    """megatron-cp-bench packed runs end to end (2 gloo ranks, tiny sizes) and reports every row."""
    import json
    import subprocess
    import sys

    from megatron_cp_plugin.bench.packed import document_lengths

    lens = document_lengths(4096, 300, 4, seed=1)
    assert sum(lens) == 4096 and all(n % 4 == 0 and n > 0 for n in lens) and max(lens) > 2 * min(lens)
    stem = tmp_path / "packed"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "megatron_cp_plugin.bench", "packed", "--tokens", "256", "--mean-doc", "32", "--heads", "4",
           "--kv-heads", "2", "--head-dim", "16", "--warmup", "1", "--iters", "1", "--out", str(stem)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {r["algo"]: r for r in json.loads((tmp_path / "packed.json").read_text())["rows"]}
    single = [r for name, r in rows.items() if name.startswith("single-GPU varlen (")]   # math on CPUs, FA2 on GPUs
    assert len(single) == 1 and single[0]["fwd_bwd_x_varlen"] == 1.0
    for algo in mcp.ALGORITHMS:
        for kind in ("packed", "unpacked"):
            assert rows[f"{algo} {kind}"]["fwd_bwd_ms"] > 0 and rows[f"{algo} {kind}"]["MB_sent_fwd_bwd"] > 0


def _packed_with_free(rank, world, stem, free):
    """packed.bench on this pool rank with `free` bytes free on its device (patched)."""
    from megatron_cp_plugin.bench import _common, packed

    saved = _common.free_bytes
    _common.free_bytes = lambda device: free
    try:
        a = packed.parser().parse_args(["--tokens", "256", "--mean-doc", "32", "--heads", "4", "--kv-heads", "2",
                                        "--head-dim", "16", "--warmup", "0", "--iters", "1", "--algos", "ring",
                                        "--out", stem])
        return packed.bench(a, rank, world, torch.device("cpu"))
    finally:
        _common.free_bytes = saved


def test_packed_bench_row_that_does_not_fit_is_not_run(pools, tmp_path):
    """With less free memory than a packed row needs (its reordered copies on top of the unpacked row's), that row
    is reported not run on every rank and the unpacked one and the single-GPU rows run."""
    from megatron_cp_plugin.bench.cp_attention import attention_need

    shape = dict(h=4, hk=2, d=16, elem=4)
    unpacked, packed_ = (attention_need("ring", 256, 2, packed=p, **shape) for p in (False, True))
    assert attention_need("single", 256, 1, **shape) < unpacked < packed_
    rows = pools(2).run(_packed_with_free, str(tmp_path / "packed"), (unpacked + packed_) / 2, timeout=240)[0]
    by = {r["algo"]: r for r in rows}
    assert by["ring unpacked"]["fwd_bwd_ms"] > 0 and "not_run" not in by["ring unpacked"]
    assert by["ring packed"]["not_run"].startswith("not run: needs ") and "fwd_bwd_ms" not in by["ring packed"]
    single = [r for name, r in by.items() if name.startswith("single-GPU varlen")]
    assert single[0]["fwd_bwd_x_varlen"] == 1.0
    assert "| not_run |" in (tmp_path / "packed.md").read_text()
