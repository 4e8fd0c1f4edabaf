"""The decode step's fused RMSNorm / LayerNorm (kernels/norm.py) against an fp64 definition and torch's own
modules; on CPU through Triton's interpreter (conftest sets TRITON_INTERPRET=1), on GPUs the compiled kernel.
And the stand-in (inference/hooks.FusedNorm) that the static decode step swaps in for a model's norms."""
from __future__ import annotations

import copy

import pytest
import torch

from megatron_cp_plugin.inference.hooks import FusedNorm, norm_slots, swapped
from megatron_cp_plugin.kernels.flash_decode import available
from megatron_cp_plugin.kernels.norm import fused_norm, norm_reference

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _fp64(x, w, b, eps, rms):
    x = x.double()
    if not rms:
        x = x - x.mean(-1, keepdim=True)
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    y = y * w.double() if w is not None else y
    return y + b.double() if b is not None else y


@pytest.mark.parametrize("backend", [None, "triton"])
@pytest.mark.parametrize("rms, affine", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("shape, dtype", [((1, 2, 4096), torch.bfloat16), ((3, 1, 1000), torch.float32),
                                          ((5, 77), torch.float16)])
def test_fused_norm_matches_fp64(backend, rms, affine, shape, dtype):
    if backend == "triton" and not available(DEV):
        pytest.skip("SKIPPED LOUDLY: triton not installed")
    g = torch.Generator().manual_seed(shape[-1])
    n = shape[-1]
    x = (3 * torch.randn(shape, generator=g) + 0.5).to(DEV, dtype)     # an offset: LayerNorm's mean matters
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(DEV, dtype) if affine else None
    b = (0.1 * torch.randn(n, generator=g)).to(DEV, dtype) if affine and not rms else None
    y = fused_norm(x, w, b, 1e-5, rms=rms, backend=backend)
    assert y.dtype == dtype and y.shape == x.shape
    want = _fp64(x, w, b, 1e-5, rms)
    ulp = torch.finfo(dtype).eps
    # Rounded once from fp32: within an output ulp (plus fp32's own error for fp32 outputs).
    assert ((y.double() - want).abs() <= ulp * want.abs() + 1e-6).all()


def test_fused_norm_refuses_a_weight_of_the_wrong_size():
    with pytest.raises(ValueError, match=r"weight must be \[8\]"):
        fused_norm(torch.ones(2, 8), torch.ones(4))


def test_fp64_keeps_the_reference():
    """The kernel computes in fp32: an fp64 norm (the shared-GPU tests' decode models) is the reference's, and the
    forced kernel refuses it."""
    x, w = torch.randn(2, 64, dtype=torch.float64, device=DEV), torch.rand(64, dtype=torch.float64, device=DEV)
    assert torch.equal(fused_norm(x, w, None, 1e-6), norm_reference(x, w, None, 1e-6))
    if available(DEV):
        with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
            fused_norm(x, w, None, 1e-6, backend="triton")


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])   # fp32: megatron-core's local spec
@pytest.mark.parametrize("make", [lambda: torch.nn.RMSNorm(64, eps=1e-6), lambda: torch.nn.RMSNorm(64),
                                  lambda: torch.nn.LayerNorm(64, eps=1e-5)])
def test_stand_in_gives_the_modules_output(make, weight_dtype):
    module = make()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        module.weight.copy_(1 + 0.1 * torch.randn(64, generator=g))
        if getattr(module, "bias", None) is not None:
            module.bias.copy_(0.1 * torch.randn(64, generator=g))
    module = module.to(DEV, weight_dtype)
    x = torch.randn(1, 3, 64, generator=g).to(DEV, torch.bfloat16)
    ours = FusedNorm(module)(x)
    if DEV.type == "cuda" and isinstance(module, torch.nn.LayerNorm) and weight_dtype != x.dtype:
        # torch's CUDA layer_norm refuses mixed dtypes ("expected scalar type BFloat16 but found Float", H100,
        # torch 2.11); its CPU kernel takes them, with the same fp32 math and one cast: the reference there.
        theirs = copy.deepcopy(module).cpu()(x.cpu()).to(DEV)
    else:
        theirs = module(x)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    ours, theirs = ours.double(), theirs.double()
    # torch rounds at the same place (fp32 math, one cast): almost all equal, the rest one bf16 ulp apart (a
    # wrong eps, bf16's instead of fp32's, moves most of them).
    assert ((ours - theirs).abs() <= 2 ** -7 * theirs.abs() + 1e-6).all()
    assert (ours != theirs).double().mean() <= 0.05


def test_swapped_norms_replaces_every_norm_and_puts_them_back():
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm = torch.nn.RMSNorm(16)
            self.pre_mlp_layernorm = torch.nn.LayerNorm(16)
            self.core_attention = torch.nn.Identity()
            self.mlp = torch.nn.Linear(16, 16)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(), Layer()])
            self.final_layernorm = torch.nn.RMSNorm(16)

    model = Model()
    ln = model.layers[1].pre_mlp_layernorm
    own = [getattr(p, n) for p, n in norm_slots(model)]
    assert len(own) == 5
    with swapped(model, norms=True):
        inside = [getattr(p, n) for p, n in norm_slots(model)]
        assert inside == [] and isinstance(model.final_layernorm, FusedNorm)
        assert model.layers[1].pre_mlp_layernorm.inner is ln
    assert [getattr(p, n) for p, n in norm_slots(model)] == own
    with pytest.raises(RuntimeError), swapped(model, norms=True):
        raise RuntimeError("a failing step")
    assert [getattr(p, n) for p, n in norm_slots(model)] == own


def test_reference_is_torchs_rms_norm_in_fp32():
    x = torch.randn(4, 32, dtype=torch.float32)
    w = torch.rand(32) + 0.5
    torch.testing.assert_close(norm_reference(x, w, None, 1e-5), torch.nn.functional.rms_norm(x, (32,), w, 1e-5))


def test_norm_bench_without_a_gpu_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the benchmark runs (scripts/gpu_decode_profile.sh's machine runs it)")
    from megatron_cp_plugin.bench.norm import main
    assert main([]) == 0
    assert "no GPU here" in capsys.readouterr().out
