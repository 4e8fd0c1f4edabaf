"""RoPE + cache append of a decoded token (kernels/rope_append.py) against an fp64 rotate-half definition; on
CPU through Triton's interpreter (conftest sets TRITON_INTERPRET=1), on GPUs the compiled kernel."""
from __future__ import annotations

import pytest
import torch

from megatron_cp_plugin.kernels.flash_decode import available
from megatron_cp_plugin.kernels.rope_append import rope_append, rope_append_reference

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _megatron_rope(x, freqs):
    """fp64 Megatron rotate-half RoPE of x [..., d] on its first 2 * len(freqs) dims."""
    r = 2 * freqs.shape[0]
    emb = torch.cat([freqs, freqs]).double().to(x.device)
    t, rest = x.double()[..., :r], x.double()[..., r:]
    half = torch.cat([-t[..., r // 2:], t[..., :r // 2]], -1)
    return torch.cat([t * emb.cos() + half * emb.sin(), rest], -1)


@pytest.mark.parametrize("backend", [None, "triton"])
@pytest.mark.parametrize("b, h, h_kv, d, r, dtype", [(2, 8, 2, 64, 64, torch.float32), (1, 4, 4, 128, 64, torch.float32),
                                                      (3, 6, 2, 64, 64, torch.bfloat16)])
def test_rope_append_matches_the_definition(backend, b, h, h_kv, d, r, dtype):
    if backend == "triton" and not available(DEV):
        pytest.skip("SKIPPED LOUDLY: triton not installed")
    g = torch.Generator().manual_seed(b * h + d)
    qkv = torch.randn(1, b, h + 2 * h_kv, d, generator=g).to(DEV, dtype)          # Megatron's split views
    q, k, v = (x.transpose(0, 1) for x in (qkv[:, :, :h], qkv[:, :, h:h + h_kv], qkv[:, :, h + h_kv:]))
    freqs = 131071.0 * (1.0 / 10000 ** (torch.arange(0, r, 2, dtype=torch.float32) / r))   # a far position
    cos, sin = freqs.cos().to(DEV), freqs.sin().to(DEV)
    kc, vc = (torch.randn(b, 9, h_kv, d, generator=g).to(DEV, dtype) for _ in range(2))
    before = (kc.clone(), vc.clone())
    slot = torch.tensor([4], device=DEV)
    out = rope_append(q, k, v, cos, sin, slot, kc, vc, backend=backend)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.double() - _megatron_rope(q, freqs)).abs().max() <= tol * 10
    assert (kc[:, 4:5].double() - _megatron_rope(k, freqs)).abs().max() <= tol * 10
    assert torch.equal(vc[:, 4:5], v)
    keep = torch.arange(9) != 4
    assert torch.equal(kc[:, keep], before[0][:, keep]) and torch.equal(vc[:, keep], before[1][:, keep])
    if backend == "triton" and dtype == torch.float32:        # the kernel computes as the reference does
        kr, vr = before[0].clone(), before[1].clone()
        ref = rope_append_reference(q, k, v, cos, sin, slot, kr, vr)
        if DEV.type == "cpu":                 # the interpreter: the same numpy operations, bit for bit
            assert torch.equal(out, ref) and torch.equal(kr, kc)
        else:                                 # compiled: x cos + y sin fused into FMAs, one rounding less
            torch.testing.assert_close(out, ref, rtol=2e-7, atol=2e-7)
            torch.testing.assert_close(kr, kc, rtol=2e-7, atol=2e-7)


def test_rope_append_bad_input():
    q = torch.zeros(1, 1, 4, 64)
    k = torch.zeros(1, 1, 2, 64)
    cache = torch.zeros(1, 5, 2, 64)
    with pytest.raises(ValueError, match="cos, sin"):
        rope_append(q, k, k, torch.zeros(40), torch.zeros(40), torch.zeros(1, dtype=torch.long), cache, cache)
    with pytest.raises(ValueError, match="caches"):
        rope_append(q, k, k, torch.zeros(8), torch.zeros(8), torch.zeros(1, dtype=torch.long), cache[:, :, :1],
                    cache[:, :, :1])
