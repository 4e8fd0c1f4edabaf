"""The decode step's fused linear (kernels/gemv.py) against its fp32 definition and an fp64 one; on CPU through
Triton's interpreter (conftest sets TRITON_INTERPRET=1), on GPUs the compiled kernel. And the stand-in
(inference/hooks.FusedLinear) that the static decode step swaps in for a layer's linears, on a real GPTModel."""
from __future__ import annotations

import pytest
import torch

from megatron_cp_plugin.kernels import gemv as G
from megatron_cp_plugin.kernels.flash_decode import available

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _exact(x, w, b, gelu):
    y = x.double() @ w.double().T + (0 if b is None else b.double())
    return torch.nn.functional.gelu(y) if gelu else y


def _tolerance(x, w, y_exact, dtype):
    """One rounding of the output (two ulps where Triton's CPU interpreter truncates bf16), plus fp32 accumulation
    (through GELU's slope, at most 1.13): 16 fp32 ulps of sum |x w|, where K = 2100 terms could in the worst case
    lose 2100, but blocked sums of random terms lose ~sqrt(K); TF32 products (2^-11 each) would lose ~0.02 of it."""
    ulp = torch.finfo(dtype).eps * (2 if DEV.type == "cpu" and dtype == torch.bfloat16 else 1)
    acc = (x.double().abs() @ w.double().abs().T) * 16 * torch.finfo(torch.float32).eps
    return ulp * y_exact.abs() + 1.2 * acc + 1e-30


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias, gelu, res", [(True, False, False), (True, True, False), (False, False, False),
                                            (True, False, True)])
def test_gemv_is_the_fp32_definition(rows, dtype, bias, gelu, res):
    if not available(DEV):
        pytest.skip("SKIPPED LOUDLY: triton not installed")
    g = torch.Generator().manual_seed(rows)
    n, k = 50, 2100                            # odd sizes: a partial block of rows and of K (1024 / 512 a step)
    x = torch.randn(1, rows, k, generator=g).to(DEV, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEV, dtype)
    b = torch.randn(n, generator=g).to(DEV, dtype) if bias else None
    r = (8 * torch.randn(1, rows, n, generator=g)).to(DEV, dtype) if res else None        # the residual stream
    y = G.gemv(x, w, b, gelu=gelu, residual=r, backend="triton")
    assert y.shape == (1, rows, n) and y.dtype == dtype
    exact = _exact(x, w, b, gelu) + (0 if r is None else r.double())
    tol = _tolerance(x, w, exact, dtype)
    assert ((y.double() - exact).abs() <= tol).all()
    assert ((G.gemv_reference(x, w, b, gelu=gelu, residual=r).double() - exact).abs() <= tol).all()


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("parts", [2, 3])
def test_gemv_of_column_slices_into_fp32_buffers_sums_to_the_whole(rows, parts):
    """The split MLP's fc2 (inference/split_mlp.py): each rank multiplies its slice of the columns (strided rows, no
    copy) into an fp32 buffer; the partials sum to the whole product within fp32 accumulation, and the kernel reads
    the strided rows (a weight row stride taken as K gives other values: red)."""
    if not available(DEV):
        pytest.skip("SKIPPED LOUDLY: triton not installed")
    g = torch.Generator().manual_seed(rows * 10 + parts)
    n, k = 50, 2100 * parts
    x = torch.randn(rows, k, generator=g).to(DEV, torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEV, torch.bfloat16)
    total = torch.zeros(rows, n, dtype=torch.float64, device=DEV)
    for p in range(parts):
        cols = slice(p * k // parts, (p + 1) * k // parts)
        out = torch.full((rows, n), float("nan"), device=DEV)
        assert G.gemv(x[:, cols], w[:, cols], out=out, backend="triton") is out and not w[:, cols].is_contiguous()
        exact = _exact(x[:, cols], w[:, cols], None, False)
        assert ((out.double() - exact).abs() <= _tolerance(x[:, cols], w[:, cols], exact, torch.float32)).all()
        total += out.double()
    exact = _exact(x, w, None, False)
    assert ((total - exact).abs() <= _tolerance(x, w, exact, torch.float32)).all()
    with pytest.raises(ValueError, match=r"out must be a contiguous \(5, 50\)"):
        G.gemv(torch.zeros(5, k, dtype=torch.bfloat16, device=DEV), w, out=torch.zeros(5, 51, device=DEV))


@pytest.mark.parametrize("rows", [1, 5])
def test_gemv_writes_megatrons_fused_qkv_grouped(rows):
    """grouped=: the fused QKV's rows are per KV group [its q heads, k, v]; the output is [all q | all k | all v]
    (hooks.GroupedQKV), so each head's values are where megatron-core's split and reshape put them (red with a
    group's k written at the v offset)."""
    if not available(DEV):
        pytest.skip("SKIPPED LOUDLY: triton not installed")
    groups, per, hn = 3, 2, 8
    gq = G.Grouped(per * hn, hn, groups)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 40, generator=g).to(DEV)
    w = torch.randn(groups * (per + 2) * hn, 40, generator=g).to(DEV)
    y = G.gemv(x, w, grouped=gq, backend="triton")
    plain = G.gemv_reference(x, w).view(rows, groups, (per + 2) * hn)             # megatron-core's layout
    q, kv = y[:, :groups * per * hn], y[:, groups * per * hn:]
    assert torch.allclose(q.view(rows, groups, per * hn), plain[..., :per * hn], rtol=1e-5, atol=1e-5)
    assert torch.allclose(kv[:, :groups * hn].view(rows, groups, hn), plain[..., per * hn:(per + 1) * hn],
                          rtol=1e-5, atol=1e-5)
    assert torch.allclose(kv[:, groups * hn:].view(rows, groups, hn), plain[..., (per + 1) * hn:], rtol=1e-5,
                          atol=1e-5)
    assert torch.allclose(G.gemv_reference(x, w, grouped=gq), y, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="must cover the weight's 96 rows"):
        G.gemv(x, w, grouped=G.Grouped(hn, hn, groups))


def test_gemv_takes_the_reference_where_the_kernel_cannot():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(8, 32, generator=g, dtype=torch.float64), torch.randn(8, generator=g, dtype=torch.float64)
    x = torch.randn(2, 32, generator=g, dtype=torch.float64)
    assert not G.takes(x, w, b) and torch.equal(G.gemv(x, w, b), G.gemv_reference(x, w, b))   # fp64
    many = torch.randn(G.MAX_ROWS + 1, 32, generator=g).to(DEV)
    assert not G.takes(many, w.float().to(DEV)) and torch.equal(G.gemv(many, w.float().to(DEV)),
                                                                G.gemv_reference(many, w.float().to(DEV)))
    with pytest.raises(ValueError, match=r"weight must be \[N, 32\]"):
        G.gemv(x, w.T)
    with pytest.raises(ValueError, match=r"bias must be \[8\]"):
        G.gemv(x, w, b[:4])
    with pytest.raises(ValueError, match="backend='triton' needs"):
        G.gemv(x, w, b, backend="triton")
    with pytest.raises(ValueError, match=r"residual must be \(2, 8\)"):
        G.gemv(x, w, b, residual=torch.zeros(2, 4, dtype=torch.float64))


def _gpt_logits(rank, world, dtype_name):
    """In a worker: the tiny GPT's logits for one decode-sized input (2 tokens of one sequence) without and with
    the linears stood in for (FusedLinear, the kernel forced on this device), and what was stood in for."""
    import warnings
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps

    from megatron_cp_plugin.inference import hooks
    from megatron_cp_plugin.megatron import CPConfig
    from megatron_cp_plugin.megatron.model import build_gpt, tiny_config
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(context_parallel_size=1)
    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    model = build_gpt(tiny_config(cp_size=1, dtype=dtype), CPConfig(algo="ring", cp_size=1), vocab_size=257,
                      seq_length=16, cp_group=ps.get_context_parallel_group()).to(DEV).eval()
    tokens = torch.randint(0, 257, (1, 2), generator=torch.Generator().manual_seed(1)).to(DEV)
    pos = torch.arange(2, device=DEV)[None]
    found = hooks.linear_slots(model)
    slots = [(n, fuse, gelu) for _, n, fuse, gelu in found]
    owns = [getattr(p, n) for p, n, _, _ in found]
    takes, gemv = G.takes, G.gemv
    with_residual = []
    G.takes = lambda x, w, b=None: x.dtype in G.DTYPES and x.numel() // x.shape[-1] <= G.MAX_ROWS
    G.gemv = lambda *a, **k: with_residual.append(tuple(k.get(n) is not None for n in ("residual", "grouped"))
                                                 ) or gemv(*a, **k, backend="triton")
    try:
        with torch.no_grad():
            want = model(tokens, pos, None)
            with hooks.swapped(model, linears=True, bda=True, norms=True):
                stood = [type(getattr(p, n)).__name__ for p, n, _, _ in found]
                got = model(tokens, pos, None)
    finally:
        G.takes, G.gemv = takes, gemv
    back = [getattr(p, n) for p, n, _, _ in found]
    back.append(not any("get_query_key_value_tensors" in vars(m) for m in model.modules()))    # the method, deleted
    return (want.float().cpu(), got.float().cpu(), slots, stood, all(a is b for a, b in zip(owns, back)) and back[-1],
            [m.activation_func is torch.nn.functional.gelu for m in hooks.bias_gelu_mlps(model)], with_residual)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_linears_stand_in_for_a_gpt_models_and_give_its_logits(pools, dtype):
    if not available(DEV):
        pytest.skip("SKIPPED LOUDLY: triton not installed")
    want, got, slots, stood, restored, gelu_back, with_residual = pools(1).run(_gpt_logits, dtype)[0]
    layers = len(slots) // 4
    assert layers >= 2 and [n for n, _, _ in slots] == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"] * layers
    # every bias in the kernel; fc1 (megatron-core's plain GELU MLP) with GELU
    assert all(fuse for _, fuse, _ in slots) and [g for n, _, g in slots if n == "linear_fc1"] == [True] * layers
    assert stood == ["FusedLinear"] * len(slots) and restored and gelu_back == [True] * layers
    # linear_proj and linear_fc2 add the residual (hooks.ResidualLink); QKV writes q, k, v grouped (hooks.GroupedQKV)
    assert with_residual == [(False, True), (True, False), (False, False), (True, False)] * layers
    # the same logits up to the kernel's order of summation (and, in bf16, one rounding of each linear less)
    scale = want.abs().max()
    assert (got - want).abs().max() <= (1e-5 if dtype == "float32" else 0.05) * scale


def test_config_is_chosen_per_device(monkeypatch):
    """config() takes the H200's sweep on an H200 and the H100's everywhere else (CPU, no device given, other GPUs):
    the 8B decode shape's four linears at 1 and 8 rows, as swept (kernels/gemv.py config)."""
    from megatron_cp_plugin.kernels import gemv as G

    shapes = [(6144, 4096), (4096, 4096), (14336, 4096), (4096, 14336)]
    h100 = [[G.config(m, n, k) for n, k in shapes] for m in (1, 8)]
    assert h100 == [[(4, 1024, 4, 4), (4, 1024, 4, 4), (4, 1024, 8, 4), (4, 1024, 4, 4)],
                    [(32, 256, 4, 3), (32, 512, 4, 3), (32, 128, 4, 3), (32, 512, 4, 3)]]
    assert [[G.config(m, n, k, torch.device("cpu")) for n, k in shapes] for m in (1, 8)] == h100
    for name, want in (("NVIDIA H100 80GB HBM3", h100),
                       ("NVIDIA H200", [[(8, 1024, 8, 4), (8, 1024, 4, 4), (8, 1024, 4, 4), (4, 1024, 4, 4)],
                                        [(64, 256, 4, 4), (32, 256, 4, 4), (64, 128, 4, 3), (32, 256, 4, 4)]])):
        monkeypatch.setattr(G, "_device_name", lambda index, name=name: name)
        assert [[G.config(m, n, k, torch.device("cuda", 0)) for n, k in shapes] for m in (1, 8)] == want, name


def test_the_benchmark_times_one_ranks_split_mlp_shapes(capsys):
    """bench gemv --split P adds what a CP rank runs with the MLPs split (inference/split_mlp.py): fc1's ffn / P rows
    with GELU, and fc2's ffn / P columns of the whole [hidden, ffn] weight; a P that does not divide ffn is refused
    before anything runs."""
    from megatron_cp_plugin.bench import gemv as bg

    fc1, fc2 = bg.split_shapes(2)
    assert fc1 == ("fc1/2", 7168, 4096, True, None) and fc2 == ("fc2/2", 4096, 7168, False, 14336)
    assert [s[1:3] for s in bg.split_shapes(4)] == [(3584, 4096), (4096, 3584)]
    for bad in ("1", "5"):
        with pytest.raises(SystemExit):
            bg.main(["--split", bad])
        assert "--split takes CP sizes >= 2 that divide the ffn 14336" in capsys.readouterr().err
