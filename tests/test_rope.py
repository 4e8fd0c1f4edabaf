"""Training RoPE in one kernel (kernels/rope.py) against megatron-core's unfused RoPE in fp64, forward and
backward; on CPU through Triton's interpreter (conftest sets TRITON_INTERPRET=1), on GPUs the compiled kernel. And
the trainer's wiring: megatron-core's fused-RoPE slot filled (megatron/compat.py), its config accepting the flag."""
from __future__ import annotations

import pytest
import torch

from megatron_cp_plugin.kernels.flash_decode import available
from megatron_cp_plugin.kernels.rope import _trig, fused_rope, rope_apply, rope_reference

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _megatron(t, freqs):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    return _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=False)


def _table(s, r, b_f=1, far=0):
    """Megatron's table layout [s, b_f, 1, r]: cat(f, f) of position x inverse frequency, positions from `far`."""
    inv = 1.0 / 10000 ** (torch.arange(0, r, 2, dtype=torch.float32) / r)
    pos = far + torch.arange(s * b_f, dtype=torch.float32).view(s, b_f)
    f = pos[..., None] * inv
    return torch.cat([f, f], -1)[:, :, None, :]


@pytest.mark.parametrize("backend", [None, "triton"])
@pytest.mark.parametrize("s, b, h, d, r, b_f, dtype", [
    (7, 2, 3, 10, 10, 1, torch.float32),        # odd sizes, r = d
    (5, 1, 40, 80, 80, 1, torch.float32),       # GPT-3 2.7B's head dim, two blocks of heads (32 + 8)
    (6, 3, 4, 16, 8, 3, torch.float32),         # rotary_percent 0.5 (dims 8.. pass through), a table per sample
    (9, 2, 5, 64, 64, 1, torch.bfloat16),
])
def test_fused_rope_matches_megatron_in_fp64(backend, s, b, h, d, r, b_f, dtype):
    if backend == "triton" and not available(DEV):
        pytest.skip("SKIPPED LOUDLY: triton not installed")
    g = torch.Generator().manual_seed(s * h + d)
    qkv = torch.randn(s, b, h, 3 * d, generator=g).to(DEV, dtype)     # q as megatron-core's split: a strided view
    t = qkv[..., :d].detach().requires_grad_(True)
    freqs = _table(s, r, b_f, far=131000).to(DEV)
    grad = torch.randn(s, b, h, d, generator=g).to(DEV, dtype)
    out = fused_rope(t, freqs, backend=backend)
    out.backward(grad)
    t64 = t.detach().double().requires_grad_(True)
    want = _megatron(t64, freqs.double())
    want.backward(grad.double())
    tol = 2e-6 if dtype == torch.float32 else 1e-2                 # bf16: one rounding of values of order 3
    assert out.dtype == dtype and out.is_contiguous() and out.shape == t.shape
    assert (out.double() - want).abs().max() <= tol * want.abs().max()
    assert (t.grad.double() - t64.grad).abs().max() <= tol * t64.grad.abs().max()
    if backend == "triton" and DEV.type == "cpu" and dtype == torch.float32:
        # the interpreter runs the reference's arithmetic bit for bit (its bf16 stores round differently)
        cos, sin = _trig(freqs)
        assert torch.equal(out, rope_reference(t.detach(), cos, sin))
        assert torch.equal(t.grad, rope_reference(grad, cos, sin, backward=True))


def test_reference_backward_is_the_forwards_gradient():
    """rope_reference(backward=True) is the transpose of the forward: <R x, y> = <x, R^T y> in fp64."""
    g = torch.Generator().manual_seed(3)
    x, y = (torch.randn(4, 2, 3, 12, generator=g, dtype=torch.float64) for _ in range(2))
    cos, sin = _trig(_table(4, 12, far=7).double())
    lhs = (rope_reference(x, cos, sin) * y).sum()
    rhs = (x * rope_reference(y, cos, sin, backward=True)).sum()
    assert abs(float(lhs - rhs)) <= 1e-12 * float(x.abs().sum())


def test_trig_table_is_cached_per_table_and_refreshed_when_it_changes():
    f = _table(3, 4)
    c1, _ = _trig(f)
    assert _trig(f)[0] is c1
    f.mul_(2)                                            # in place: its version moves on
    c2, _ = _trig(f)
    assert c2 is not c1 and torch.equal(c2, f.view(3, 1, 4).cos())


def test_fused_rope_bad_input():
    t = torch.zeros(4, 1, 2, 8)
    with pytest.raises(ValueError, match="interleaved"):
        fused_rope(t, _table(4, 8), interleaved=True)
    with pytest.raises(ValueError, match="freqs"):
        fused_rope(t, _table(4, 8)[:, :, 0])
    with pytest.raises(ValueError, match="even r <= head_dim"):
        rope_apply(t, *_trig(_table(4, 10)))


def test_megatron_config_takes_the_flag_once_the_slot_is_filled():
    """megatron-core refuses apply_rope_fusion without TE; after install_fused_rope its config accepts it and
    apply_rotary_pos_emb runs our kernel (interleaved calls go to its own function)."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import TransformerConfig

    from megatron_cp_plugin.megatron.compat import install_fused_rope

    before = rope_utils.fused_apply_rotary_pos_emb
    try:
        install_fused_rope()
        assert rope_utils.fused_apply_rotary_pos_emb is not None
        if before is not None:                           # TE installed: its kernel stays
            assert rope_utils.fused_apply_rotary_pos_emb is before
            return
        cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, apply_rope_fusion=True)
        t, freqs = torch.randn(5, 2, 4, 8), _table(5, 8, far=40)
        got = rope_utils.apply_rotary_pos_emb(t, freqs, cfg, cp_group=_Lone())
        torch.testing.assert_close(got, _megatron(t, freqs), rtol=1e-6, atol=1e-6)
        inter = rope_utils.fused_apply_rotary_pos_emb(t, freqs, interleaved=True)
        torch.testing.assert_close(inter, rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=True))
    finally:
        rope_utils.fused_apply_rotary_pos_emb = before


class _Lone:
    """A one-rank CP group for apply_rotary_pos_emb (which only asks its size and rank)."""

    def size(self):
        return 1

    def rank(self):
        return 0


def test_trainer_fuses_rope_on_gpus_only_and_not_for_packed_documents():
    from types import SimpleNamespace

    from megatron_cp_plugin.training.config import parse_args, rope_fusion_on

    assert rope_fusion_on(parse_args([]), gpu=True)
    assert not rope_fusion_on(parse_args([]), gpu=False)
    assert not rope_fusion_on(parse_args(["--no-rope-fusion"]), gpu=True)
    assert not rope_fusion_on(SimpleNamespace(apply_rope_fusion=True, reset_attention_mask=True), gpu=True)


def test_rope_bench(capsys, tmp_path):
    """Without a GPU it says so; on one, the fused forward is one kernel and fwd + bwd launch fewer than megatron's."""
    import json

    from megatron_cp_plugin.bench.rope import main
    assert main(["--shapes", "1024x40x80", "--iters", "3", "--out", str(tmp_path / "r")]) == 0
    if not torch.cuda.is_available():
        assert "no GPU here" in capsys.readouterr().out
        return
    unfused, fused = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert fused["kernels_fwd"] == 1 and unfused["kernels_fwd"] > 5
    assert fused["kernels_fwd_bwd"] < unfused["kernels_fwd_bwd"]


def test_the_trainers_gpu_config_runs_rope_through_the_kernel(monkeypatch):
    """transformer_config(gpu=True) turns apply_rope_fusion on and fills the slot, so megatron-core's
    apply_rotary_pos_emb reaches kernels/rope.py (here its CPU path: the reference)."""
    from megatron.core.models.common.embeddings import rope_utils

    import megatron_cp_plugin.kernels.rope as kr
    from megatron_cp_plugin.training.config import parse_args, transformer_config

    before = rope_utils.fused_apply_rotary_pos_emb
    calls = []
    monkeypatch.setattr(kr, "rope_apply", lambda *a, **k: calls.append(1) or rope_apply(*a, **k))
    small = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--context-parallel-size", "1"]
    try:
        cfg = transformer_config(parse_args(small), gpu=True)
        assert cfg.apply_rope_fusion
        t, freqs = torch.randn(5, 2, 4, 8, requires_grad=True), _table(5, 8, far=40)
        got = rope_utils.apply_rotary_pos_emb(t, freqs, cfg, cp_group=_Lone())
        got.sum().backward()
        torch.testing.assert_close(got, _megatron(t.detach(), freqs), rtol=1e-6, atol=1e-6)
        assert len(calls) == (0 if before is not None else 2)        # TE's kernel where installed
        assert not transformer_config(parse_args(small), gpu=False).apply_rope_fusion
    finally:
        rope_utils.fused_apply_rotary_pos_emb = before


def test_no_rope_fusion_reaches_megatron_lm_by_name(monkeypatch):
    """--no-rope-fusion is Megatron-LM's flag too: passed through by name (a store_false flag, not `flag False`)."""
    import megatron_cp_plugin.megatron_lm.flags as fl
    from megatron_cp_plugin.training.config import build_parser, parse_args

    monkeypatch.setattr(fl, "have_te", lambda: True)           # TE present: NO_TE_FLAGS would add it anyway
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8"]
    off = fl.megatron_lm_flags(parse_args(base + ["--no-rope-fusion"]), build_parser(), world_size=1, layout="zero1")
    on = fl.megatron_lm_flags(parse_args(base), build_parser(), world_size=1, layout="zero1")
    assert off.count("--no-rope-fusion") == 1 and "--no-rope-fusion" not in on
    assert "True" not in off and "False" not in off
