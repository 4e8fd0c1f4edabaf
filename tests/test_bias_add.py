"""The decode step's fused bias + residual add (kernels/bias_add.py) against torch's two adds, bit for bit, and an
fp64 definition; on CPU through Triton's interpreter (conftest sets TRITON_INTERPRET=1), on GPUs the compiled
kernel. And the stand-in (inference/hooks.FusedBiasDropoutAdd) that the static decode step swaps in for a layer's
bias-dropout-adds."""
from __future__ import annotations

import functools

import pytest
import torch

from megatron_cp_plugin.inference import hooks
from megatron_cp_plugin.inference.hooks import (FusedBiasDropoutAdd, FusedBiasGelu, bda_slots, bias_gelu_mlps,
                                                swapped)
from megatron_cp_plugin.kernels.bias_add import (bias_gelu_reference, bias_residual_reference, fused_bias_gelu,
                                                 fused_bias_residual)
from megatron_cp_plugin.kernels.flash_decode import available

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed + shape[-1])
    x, r = (torch.randn(shape, generator=g).mul(s).to(DEV, dtype) for s in (1.0, 8.0))   # residual: larger
    b = (0.5 * torch.randn(shape[-1], generator=g)).to(DEV, dtype)
    return x, b, r


@pytest.mark.parametrize("backend", [None, "triton"])
@pytest.mark.parametrize("shape, dtype", [((1, 1, 4096), torch.bfloat16), ((3, 2, 1000), torch.bfloat16),
                                          ((1, 8, 2049), torch.float16), ((5, 77), torch.float32)])
def test_fused_bias_residual_is_torchs_two_adds_bit_for_bit(backend, shape, dtype):
    if backend == "triton" and not available(DEV):
        pytest.skip("SKIPPED LOUDLY: triton not installed")
    x, b, r = _inputs(shape, dtype)
    x0, r0 = x.clone(), r.clone()
    y = fused_bias_residual(x, b, r, backend=backend)
    assert y.dtype == dtype and y.shape == x.shape and y.data_ptr() != x.data_ptr()
    want = bias_residual_reference(x, b, r)
    if backend == "triton" and DEV.type == "cpu" and dtype == torch.bfloat16:
        # Triton's CPU interpreter rounds fp32 -> bf16 toward zero whatever the rounding mode asked (2.3711 ->
        # 2.359375 where torch and the GPU's cvt.rn give 2.375): within one bf16 ulp per rounding here; the
        # compiled kernel is held to torch's bits on GPUs.
        ulp = torch.finfo(dtype).eps
        assert ((y.double() - want.double()).abs() <= 2 * ulp * (want.double().abs() + (x + b).double().abs())).all()
    else:
        assert torch.equal(y, want)                                      # each add rounded as torch's is
    assert torch.equal(x, x0) and torch.equal(r, r0)                     # the inputs are left alone
    # and the definition: two roundings to the output dtype, each within half an ulp of what it rounds
    exact = (x.double() + b.double()) + r.double()
    ulp = torch.finfo(dtype).eps
    assert ((y.double() - exact).abs() <= ulp * (exact.abs() + (x.double() + b.double()).abs()) + 1e-30).all()


def test_fused_bias_residual_refuses_mismatched_operands():
    x = torch.ones(2, 8)
    with pytest.raises(ValueError, match=r"bias must be \[8\]"):
        fused_bias_residual(x, torch.ones(4), x)
    with pytest.raises(ValueError, match="residual must be x's shape"):
        fused_bias_residual(x, torch.ones(8), torch.ones(2, 8, dtype=torch.float64))


def test_stand_in_is_megatron_cores_bias_dropout_add(monkeypatch):
    """Eval, unfused: the layer's own get_bias_dropout_add (megatron-core) and the stand-in give the same tensor,
    through the Triton kernel where it runs (interpreted on CPU); training, bias_dropout_fusion (compiled by
    megatron-core into one kernel that rounds once), no bias or an fp32 residual stream: the layer's own."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    if available(DEV):
        monkeypatch.setattr(hooks, "fused_bias_residual", functools.partial(fused_bias_residual, backend="triton"))
    calls = []
    real = hooks.fused_bias_residual
    monkeypatch.setattr(hooks, "fused_bias_residual", lambda *a, **k: calls.append(1) or real(*a, **k))
    ours = FusedBiasDropoutAdd(get_bias_dropout_add)
    x, b, r = _inputs((1, 2, 4096), torch.bfloat16)
    with torch.no_grad():
        want = get_bias_dropout_add(False, False)((x.clone(), b), r.clone(), 0.1)
        got = ours(False, False)((x, b), r, 0.1)
    if DEV.type == "cuda" or not available(DEV):
        assert torch.equal(got, want)
    else:                                   # the interpreter's bf16 rounding (see the test above)
        torch.testing.assert_close(got, want, atol=0.07, rtol=2 ** -7)
    assert len(calls) == 1
    assert ours(False, True) is get_bias_dropout_add(False, True) and len(calls) == 1   # fused: the layer's own
    x, b, r = _inputs((1, 2, 64), torch.bfloat16)
    with torch.no_grad():
        ours(False, False)((x, None), r, 0.0)                            # no bias
        ours(False, False)((x, b), r.float(), 0.0)                       # fp32 residual stream
    assert len(calls) == 1
    assert ours(True, False) is not None and len(calls) == 1             # training: the layer's own function


def test_swapped_bda_replaces_every_layers_adds_and_puts_them_back():
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn_bda = get_bias_dropout_add
            self.mlp_bda = get_bias_dropout_add
            self.core_attention = torch.nn.Identity()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(), Layer()])

    model = Model()
    assert len(bda_slots(model)) == 4
    with swapped(model, bda=True):
        assert bda_slots(model) == [] and isinstance(model.layers[1].mlp_bda, FusedBiasDropoutAdd)
        assert model.layers[1].mlp_bda.inner is get_bias_dropout_add
    assert all(getattr(m, n) is get_bias_dropout_add for m, n in bda_slots(model)) and len(bda_slots(model)) == 4
    with pytest.raises(RuntimeError), swapped(model, bda=True):
        raise RuntimeError("a failing step")
    assert len(bda_slots(model)) == 4


def test_bias_add_bench(capsys, tmp_path):
    """Without a GPU it says so; on one, its rows say the fused kernel gave torch's bits, in one launch."""
    import json

    from megatron_cp_plugin.bench.bias_add import main
    assert main(["--rows", "1", "8", "--iters", "5", "--out", str(tmp_path / "b")]) == 0
    if not torch.cuda.is_available():
        assert "no GPU here" in capsys.readouterr().out
        return
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert len(rows) == 8 and all(r["same"] for r in rows if r["op"] == "bias + residual")
    assert all(r["max_ulps"] <= 1 and r["tiny_abs"] <= 1e-6 for r in rows if r["op"] == "bias + GELU")
    assert [r["kernels"] for r in rows if "Triton" in r["impl"]] == [1, 1, 1, 1]


@pytest.mark.parametrize("backend", [None, "triton"])
@pytest.mark.parametrize("shape, dtype", [((1, 1, 4096), torch.bfloat16), ((3, 2, 1000), torch.bfloat16),
                                          ((1, 8, 2049), torch.float16), ((5, 77), torch.float32)])
def test_fused_bias_gelu_is_torchs_add_and_gelu(backend, shape, dtype):
    """The add rounded as torch's, then GELU in fp32 rounded once: torch's up to an ulp of the output (erf's last
    bits may differ between libraries), and the fp64 definition within the two roundings."""
    if backend == "triton" and not available(DEV):
        pytest.skip("SKIPPED LOUDLY: triton not installed")
    x, b, _ = _inputs(shape, dtype, seed=7)
    y = fused_bias_gelu(x, b, backend=backend)
    assert y.dtype == dtype and y.shape == x.shape
    want = bias_gelu_reference(x, b)
    ulp = torch.finfo(dtype).eps
    t = (x + b).double()                                                 # the add, rounded as torch's
    exact = 0.5 * t * (1 + torch.erf(t / 2 ** 0.5))
    if backend == "triton" and DEV.type == "cpu" and dtype == torch.bfloat16:
        # the interpreter truncates both bf16 roundings (test above): an ulp of the sum, through GELU's slope
        # (at most 1.13), and an ulp of the output
        tol = 2 * ulp * (want.double().abs() + 1.2 * t.abs())
    else:
        tol = ulp * want.double().abs() + 1e-6
    assert ((y.double() - want.double()).abs() <= tol).all()
    assert ((y.double() - exact).abs() <= tol + ulp / 2 * exact.abs()).all()


class _MLP(torch.nn.Module):
    """megatron-core's MLP.forward on its plain path (no bias-activation fusion, not gated), in miniature."""

    def __init__(self, n, f, dtype):
        super().__init__()
        self.config = type("Cfg", (), {"gated_linear_unit": False, "bias_activation_fusion": False,
                                        "use_te_activation_func": False})()
        g = torch.Generator().manual_seed(f)
        self.w1 = torch.nn.Parameter(torch.randn(f, n, generator=g).to(dtype) / n ** 0.5)
        self.b1 = torch.nn.Parameter(torch.randn(f, generator=g).to(dtype))
        self.linear_fc1 = _Linear(self.w1, self.b1)
        self.linear_fc2 = torch.nn.Identity()
        self.activation_func = torch.nn.functional.gelu

    def forward(self, h):
        inter, bias = self.linear_fc1(h)
        if bias is not None:
            inter = inter + bias
        return self.activation_func(inter)


class _Linear(torch.nn.Module):
    def __init__(self, w, b):
        super().__init__()
        self.w, self.b = w, b

    def forward(self, h):
        return h @ self.w.t(), self.b                                    # skip_bias_add=True, as MLP's fc1


def test_swapped_bda_takes_the_plain_gelu_mlps_fc1_bias_and_activation(monkeypatch):
    if available(DEV):
        monkeypatch.setattr(hooks, "fused_bias_gelu", functools.partial(fused_bias_gelu, backend="triton"))
    mlp = _MLP(64, 256, torch.float32).to(DEV)
    gated = _MLP(64, 256, torch.float32).to(DEV)
    gated.config.gated_linear_unit = True
    model = torch.nn.ModuleList([mlp, gated])
    assert bias_gelu_mlps(model) == [mlp]
    h = torch.randn(1, 2, 64, device=DEV)
    with torch.no_grad():
        want = mlp(h)
        own_fc1 = mlp.linear_fc1
        with swapped(model, bda=True):
            assert isinstance(mlp.linear_fc1, FusedBiasGelu) and mlp.activation_func is not torch.nn.functional.gelu
            assert gated.linear_fc1 is not None and not isinstance(gated.linear_fc1, FusedBiasGelu)
            got = mlp(h)
        assert mlp.linear_fc1 is own_fc1 and mlp.activation_func is torch.nn.functional.gelu
    torch.testing.assert_close(got, want, rtol=2 ** -20, atol=1e-6)
