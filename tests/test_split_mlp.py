"""The decode step's MLPs split over the CP ranks (inference/split_mlp.py): on every rank, the split MLP's output is
the whole MLP's (fp64, gloo ranks; plain GELU and SwiGLU, biases that are not zero, an uneven split at P = 3), each
rank reads only its share of the weights, and bad set-ups are refused. The tokens of a split decode step are
tests/test_generate.py's; the NVLink reduce kernel is tests/test_peer_sum.py's."""
from __future__ import annotations

import pytest
import torch


def _mlp_outputs(rank, world, gated, rows):
    import warnings
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps

    from megatron_cp_plugin.inference.hooks import swapped
    from megatron_cp_plugin.inference.split_mlp import SplitMLPs
    from megatron_cp_plugin.megatron import CPConfig
    from megatron_cp_plugin.megatron.model import build_gpt, tiny_config
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(context_parallel_size=world)
    group = ps.get_context_parallel_group()
    torch.manual_seed(0)
    cfg = tiny_config(cp_size=world, dtype=torch.float64, ffn=100)          # 100 / 3: an uneven split
    if gated:
        cfg.gated_linear_unit, cfg.activation_func = True, torch.nn.functional.silu
    model = build_gpt(cfg, CPConfig(algo="ring", cp_size=world), vocab_size=17, seq_length=8, cp_group=group)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():                                # Megatron's biases start at zero: make them count
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * (0.5 if p.dim() == 1 else 0.1))
    mlp = model.decoder.layers[1].mlp
    x = torch.randn(1, rows, cfg.hidden_size, generator=g, dtype=torch.float64)
    with torch.no_grad():
        whole, whole_bias = mlp(x)
        if whole_bias is not None:
            whole = whole + whole_bias
        split = SplitMLPs(model, group, rows=rows, peer=False)
        with swapped(model, split=split):
            out, bias = mlp(x)
        assert bias is None, "fc2's bias is added once, in the reduce"
    ffn = cfg.ffn_hidden_size
    share = [w.shape[1] for w in split.fc2_weight]
    assert all(s == ffn * (rank + 1) // world - ffn * rank // world for s in share)
    assert all(w.shape[0] == (2 if gated else 1) * s for w, s in zip(split.fc1_weight, share))
    assert all(w.data_ptr() == m.linear_fc2.weight.data_ptr() + ffn * rank // world * 8
               for w, m in zip(split.fc2_weight, split.mlps)), "fc2's share is a view of the model's weight"
    assert type(mlp.linear_fc1).__name__ == "ColumnParallelLinear", "the model's own modules are back"
    saved = split.weight_bytes_saved()
    whole_bytes = sum(m.linear_fc1.weight.nbytes + m.linear_fc1.bias.nbytes + m.linear_fc2.weight.nbytes
                      for m in split.mlps)
    return (out - whole).abs().max().item(), whole.abs().max().item(), saved, whole_bytes


@pytest.mark.parametrize("world", (1, 2, 3))
@pytest.mark.parametrize("gated", (False, True))
def test_split_mlp_is_the_whole_mlp_on_every_rank(pools, world, gated):
    res = pools(world).run(_mlp_outputs, gated, 3)
    for err, scale, saved, whole in res:
        assert scale > 1 and err <= 1e-12 * scale, (err, scale)
        assert saved == pytest.approx(whole * (world - 1) / world, rel=0.02)


def _bad(rank, world):
    from megatron.core import parallel_state as ps

    from megatron_cp_plugin.inference.split_mlp import SplitMLPs
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(context_parallel_size=world)
    SplitMLPs(torch.nn.Linear(4, 4), ps.get_context_parallel_group(), rows=1, peer=False)


def test_split_mlp_refuses_a_model_without_megatron_mlps(pools):
    out = pools(2).run_outcomes(_bad, timeout=60)
    for ok, val in out.values():
        assert not ok and val[0] == "ValueError" and "mlp='split' needs megatron-core MLPs" in val[1], val
