"""Split-KV flash-decoding (kernels/flash_decode.py) against its fp64 reference; on CPU through Triton's
interpreter (TRITON_INTERPRET=1, set in conftest), on GPUs the compiled kernel in bf16."""
from __future__ import annotations

import pytest
import torch

from megatron_cp_plugin.kernels import flash_decode as fd
from megatron_cp_plugin.kernels.local_attn import decode_fwd

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEV.type == "cuda" else torch.float32
TOL = 2e-2 if DTYPE == torch.bfloat16 else 2e-5
pytestmark = pytest.mark.skipif(not fd.available(DEV),
                                reason="SKIPPED LOUDLY: triton is not installed (pip install triton), so the "
                                       "flash-decoding kernel cannot run here, not even interpreted")

CASES = [  # b, n_q, h, h_kv, d, s
    (1, 1, 4, 1, 64, 200), (2, 3, 8, 2, 64, 37), (1, 1, 2, 2, 128, 0), (1, 2, 4, 4, 128, 130),
    (3, 1, 6, 3, 64, 1), (1, 5, 4, 2, 64, 65),
]


def _data(b, n_q, h, h_kv, d, s, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, hh, d, generator=g).to(DEV, DTYPE) for n, hh in ((n_q, h), (s, h_kv), (s, h_kv)))
    kpos = torch.randint(-1, s + 2, (b, s), generator=g).to(DEV)
    qpos = torch.randint(0, s + 1, (b, n_q), generator=g).to(DEV)
    return q, k, v, kpos, qpos


def _check(o, lse, q, k, v, **kw):
    ro, rl = fd.flash_decode_reference(q.double(), k.double(), v.double(), **kw)
    assert o.dtype == torch.float32 and lse.dtype == torch.float32
    assert o.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert torch.equal(torch.isinf(lse), torch.isinf(rl)), "rows that see no key must have lse = -inf"
    assert torch.isfinite(o).all()
    fin = torch.isfinite(rl)
    assert (o.double() - ro).abs().max().item() <= TOL
    assert (lse.double()[fin] - rl[fin]).abs().max().item() <= TOL if fin.any() else True
    assert (o[~fin.transpose(1, 2)] == 0).all() if (~fin).any() else True


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("masks", ["none", "kv", "kv+q", "q"])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_matches_reference(case, masks, splits):
    q, k, v, kpos, qpos = _data(*case, seed=hash((case, masks)) % 1000)
    kw = {"kv_positions": kpos if masks in ("kv", "kv+q") else None,
          "q_positions": qpos if masks in ("q", "kv+q") else None}
    o, lse = fd.flash_decode(q, k, v, num_splits=splits, **kw)
    _check(o, lse, q, k, v, **kw)


def test_strided_views_of_a_preallocated_cache():
    # The generation cache is a [b, capacity, h_kv, d] buffer read through [:, :n] views.
    q, k, v, _, _ = _data(2, 1, 8, 2, 64, 150, seed=1)
    kb, vb = (torch.zeros(2, 256, 2, 64, device=DEV, dtype=DTYPE) for _ in range(2))
    kb[:, :150], vb[:, :150] = k, v
    o, lse = fd.flash_decode(q, kb[:, :150], vb[:, :150], scale=0.3)
    _check(o, lse, q, k, v, scale=0.3)


def test_decode_fwd_triton_equals_math():
    q, k, v, kpos, qpos = _data(2, 2, 8, 2, 64, 90, seed=2)
    a = decode_fwd(q, k, v, kv_positions=kpos, q_positions=qpos, backend="triton")
    b = decode_fwd(q.float(), k.float(), v.float(), kv_positions=kpos, q_positions=qpos, backend="math")
    assert (a[0] - b[0]).abs().max().item() <= TOL
    fin = torch.isfinite(b[1])
    assert torch.equal(fin, torch.isfinite(a[1])) and (a[1][fin] - b[1][fin]).abs().max().item() <= TOL


@pytest.mark.parametrize("bad, match", [
    (dict(d=48), "head_dim must be one of"),
    (dict(h_kv=3), "heads must divide"),
    (dict(kpos_len=5), "kv_positions must be"),
    (dict(qpos_len=4), "q_positions must be"),
])
def test_bad_input(bad, match):
    d = bad.get("d", 64)
    q = torch.zeros(1, 2, 4, d, device=DEV, dtype=DTYPE)
    k = torch.zeros(1, 10, bad.get("h_kv", 2), d, device=DEV, dtype=DTYPE)
    kw = {}
    if "kpos_len" in bad:
        kw["kv_positions"] = torch.zeros(1, bad["kpos_len"], dtype=torch.long, device=DEV)
    if "qpos_len" in bad:
        kw["q_positions"] = torch.zeros(1, bad["qpos_len"], dtype=torch.long, device=DEV)
    with pytest.raises(ValueError, match=match):
        fd.flash_decode(q, k, k, **kw)


@pytest.mark.parametrize("P, R, d", [(1, 5, 64), (3, 7, 128), (8, 2, 64)])
def test_merge_partials(P, R, d):
    from megatron_cp_plugin.kernels.merge import merge_
    g = torch.Generator().manual_seed(P * R)
    o = torch.randn(P, R, d, generator=g).to(DEV)
    lse = torch.randn(P, R, generator=g).to(DEV)
    lse[0, 0] = float("-inf")                            # a partial that saw nothing
    if P > 1:
        lse[:, 1 % R] = float("-inf")                    # a row no partial saw
    out, acc = fd.merge_partials(o, lse)
    ro, rl = torch.zeros(1, R, 1, d, device=DEV), torch.full((1, 1, R), float("-inf"), device=DEV)
    for i in range(P):
        merge_(ro, rl, o[i][None, :, None], lse[i][None, None])
    assert torch.isfinite(out).all()
    assert torch.allclose(out, ro[0, :, 0], atol=1e-5) and torch.equal(torch.isinf(acc), torch.isinf(rl[0, 0]))
    fin = torch.isfinite(acc)
    assert torch.allclose(acc[fin], rl[0, 0][fin], atol=1e-5)


@pytest.mark.parametrize("with_pos", [False, True])
def test_kv_lengths_bound_the_keys_read(with_pos):
    # A fixed-capacity cache: row i has kv_lengths[i] keys (0 included); slots past them hold garbage (NaN:
    # a kernel reading them would show it). Workspace buffers and `out` destinations give the same result.
    b, n_q, h, h_kv, d, cap = 3, 2, 8, 2, 64, 300
    q, k, v, kpos, qpos = _data(b, n_q, h, h_kv, d, cap, seed=9)
    lens = torch.tensor([0, 130, 300], dtype=torch.int32, device=DEV)
    past = torch.arange(cap, device=DEV)[None, :] >= lens[:, None]
    k, v = (x.masked_fill(past[:, :, None, None], float("nan")) for x in (k, v))
    ref_pos = torch.where(past, -1, kpos if with_pos else torch.arange(cap, device=DEV).expand(b, cap))
    kw = {"kv_positions": kpos if with_pos else None, "q_positions": qpos if with_pos else None}
    ws = fd.Workspace()
    rows = b * h * n_q
    out = (torch.empty(rows, d, device=DEV), torch.empty(rows, device=DEV))
    for call in range(2):
        o, lse = fd.flash_decode(q, k, v, kv_lengths=lens, num_splits=4, workspace=ws,
                                 out=out if call else None, **kw)
        _check(o, lse, q, k.nan_to_num(), v.nan_to_num(), kv_positions=ref_pos, q_positions=kw["q_positions"])
    with pytest.raises(ValueError, match="kv_lengths must be"):
        fd.flash_decode(q, k, v, kv_lengths=lens[:2])


def test_merge_packed_equals_merge_partials():
    # The all-gathered layout of tree decoding: each rank's (o [R, d], lse [R]) packed into one row.
    P, R, d = 3, 7, 64
    g = torch.Generator().manual_seed(4)
    o = torch.randn(P, R, d, generator=g).to(DEV)
    lse = torch.randn(P, R, generator=g).to(DEV)
    lse[0, 2] = float("-inf")
    lse[:, 5] = float("-inf")                                         # a row no rank saw
    parts = torch.cat([o.reshape(P, -1), lse], 1)
    out, acc = fd.merge_packed(parts, d)
    ro, ra = fd.merge_partials(o, lse)
    assert torch.equal(torch.isinf(acc), torch.isinf(ra))
    if DEV.type == "cpu":       # the interpreter runs both layouts through the same numpy ops
        assert torch.equal(out, ro) and torch.equal(acc[torch.isfinite(acc)], ra[torch.isfinite(ra)])
    else:   # compiled, the two strides (455 vs 448 floats a partial) specialise differently: a few ulps apart
        torch.testing.assert_close(out, ro, rtol=4e-7, atol=1e-7)
        torch.testing.assert_close(acc[torch.isfinite(acc)], ra[torch.isfinite(ra)], rtol=4e-7, atol=1e-7)
    w = torch.softmax(lse.double().nan_to_num(neginf=-1e300), 0)            # the merge in fp64
    ref = (w[..., None] * o.double()).sum(0)
    seen = torch.isfinite(lse).any(0)
    assert (out.double() - ref)[seen].abs().max() < 1e-5 and torch.equal(out[~seen], torch.zeros_like(out[~seen]))
    low, _ = fd.merge_packed(parts, d, out_dtype=torch.bfloat16)
    assert low.dtype == torch.bfloat16 and torch.allclose(low.float(), ro, atol=1e-2)
    with pytest.raises(ValueError, match="merge_packed"):
        fd.merge_packed(parts[:, 1:], d)
