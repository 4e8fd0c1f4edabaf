"""algos/registry.py is the one list of algorithms: docs/design.md's table is its rows, the flag's values and
the shard-length rule come from it, and a toy algorithm added through a row alone (defined here, registered at
run time) trains in megatron-cp-pretrain's train(), is costed, chosen by `auto` and planned."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_cp_plugin.algos import registry

DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"
TOY = "toy-allgather"


def test_design_table_lists_exactly_the_registry_rows():
    lines = DESIGN.read_text().splitlines()
    start = lines.index("| algo | layout | family | grid | what it is |") + 2
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        name, layout, family, grid, what = (c.strip() for c in line.strip("|").split("|"))
        table.append((name.strip("`"), layout, family, grid == "yes", what))
    want = [(r.name, r.layout, r.family, r.grid, r.description) for r in registry.rows(baselines=True)]
    assert table == want


def test_flag_values_and_the_shard_rule_come_from_the_rows():
    assert registry.flag_choices() == ("auto", "ring", "burst", "attention2d", "attention2d-no", "attention2d-o",
                                       "allgather", "ulysses", "ulysses-ring")
    assert registry.candidates("attention2d") == ("attention2d-no", "attention2d-o")
    assert registry.candidates("auto", grid_given=True) == ("attention2d-no", "attention2d-o", "ulysses-ring")
    # A grid algorithm's grid without --cp-grid: Attention2D's choose_grid; ulysses-ring's largest all-to-all
    # the heads allow within a node (8 ranks), the ring across the rest.
    assert registry.get("attention2d-no").grid_shape(8, 8, 2) == (8, 1)
    assert [registry.get("ulysses-ring").grid_shape(*a) for a in ((8, 8, 2), (16, 32, 8), (6, 4, 4), (4, 2, 1))] \
        == [(1, 8), (2, 8), (3, 2), (2, 2)]
    assert [registry.divisor(a, 4) for a in ("ring", "burst", "attention2d-no", "ring-te")] == [8, 8, 4, 8]
    assert registry.any_divisor(3) == 6 and registry.document_unit("ring", 1) == 1
    with pytest.raises(ValueError, match="--seq-length 20 must be divisible by 8 for the zigzag layout of ring"):
        registry.check_length(20, "ring", 4, "--seq-length")
    registry.check_length(20, "attention2d-o", 4, "--seq-length")
    with pytest.raises(ValueError, match="algo must be one of"):
        registry.get("attention2d")                     # a flag value, not an algorithm
    with pytest.raises(ValueError, match="already"):
        registry.register(registry.get("ring"))
    with pytest.raises(ValueError, match="already"):    # a family's flag value cannot become an algorithm
        registry.register(registry.Algorithm("attention2d", "cyclic", "x", False, "m:f", "m:f", "x"))


# ------------------------------------------------------------------------------------------- the toy algorithm
class _GatherKV(torch.autograd.Function):
    """All-gather a shard along the sequence; the backward sums every rank's gradient and keeps its own part."""

    @staticmethod
    def forward(ctx, x, group):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group, ctx.rank, ctx.n = group, dist.get_rank(group), x.shape[1]
        return torch.cat(parts, 1)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g[:, ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n], None


def toy_attention(q, k, v, *, group, causal, softmax_scale, backend, comm_stats, packing):
    """Exact attention by all-gathering K, V (any layout: the row's positions give the causal mask)."""
    from megatron_cp_plugin import sequence_positions

    if packing is not None:
        raise ValueError(f"cu_seqlens: {TOY} takes no packed sequences")
    P, r = dist.get_world_size(group), dist.get_rank(group)
    pos = [sequence_positions(q.shape[1] * P, algo=TOY, rank=i, world_size=P).to(q.device) for i in range(P)]
    k, v = (_GatherKV.apply(t, group).repeat_interleave(q.shape[2] // t.shape[2], 2).float() for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k) * softmax_scale
    if causal:
        s = s.masked_fill(torch.cat(pos)[None, :] > pos[r][:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v).to(q.dtype)


def toy_cost(algo, pb, hw, rank=None):
    """All-gather of K, V forward, all-reduce of the gathered dK, dV backward, compute not overlapped."""
    from megatron_cp_plugin.cost import Prediction, attention_flops

    n_kv = pb.batch * pb.seq_len // pb.world * pb.kv_heads * pb.head_dim
    fwd_b = (pb.world - 1) * 2 * n_kv * pb.dtype_bytes
    bwd_b = 2 * (pb.world - 1) * 2 * n_kv * pb.acc_bytes
    F, B = attention_flops(pb)
    return Prediction(algo, F / hw.fwd_tflops + fwd_b / hw.intra_bw, B / hw.bwd_tflops + bwd_b / hw.intra_bw,
                      fwd_b, bwd_b, F, B)


def _register_toy():
    if TOY not in registry.names():
        registry.register(registry.Algorithm(TOY, "cyclic", "toy", False, toy_attention, toy_cost,
                                             "K, V all-gathered, exact attention (a test's toy)"))


TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
        "--seq-length", "32", "--train-iters", "3", "--mock-data", "--lr", "1e-2"]


def _train(rank, world):
    from megatron.core import parallel_state as ps

    from megatron_cp_plugin.pretrain import parse_args, train

    _register_toy()
    losses = {}
    for algo in ("ring", TOY):
        losses[algo] = train(parse_args([*TINY, "--context-parallel-algo", algo]))
        ps.destroy_model_parallel()
    return losses


def test_a_toy_algorithm_added_through_its_row_alone_trains_is_costed_and_planned(pools, monkeypatch, capsys):
    for losses in pools(2).run(_train):                # CP = 2 on gloo: the toy's losses are ring's (both exact)
        assert len(losses[TOY]) == 3 and losses[TOY] == pytest.approx(losses["ring"], abs=1e-5), losses
    monkeypatch.setattr(registry, "_ROWS", dict(registry._ROWS))    # this process's registry as it was after
    _register_toy()
    from megatron_cp_plugin import cost as cm
    from megatron_cp_plugin.bench import plan
    from megatron_cp_plugin.megatron.args import CPConfig
    from megatron_cp_plugin.training.config import parse_args

    assert TOY in registry.flag_choices() and registry.layout_of(TOY) == "cyclic"
    pb, hw = cm.Problem(12 * 1024, 3, 8, 2), cm.HARDWARE["h200-nvlink"]
    assert cm.comm_bytes(TOY, pb) == (2 * 2 * 4096 * 2 * 128 * 2, 2 * 2 * 2 * 4096 * 2 * 128 * 4)
    assert cm.Problem(12 * 1024 + 3, 3, 8).feasible(TOY) and not cm.Problem(12 * 1024 + 3, 3, 8).feasible("ring")
    best, times = cm.choose_algo(pb, hw)
    # ulysses cannot split 8 heads over 3 ranks: infinite, so left out (ulysses-ring takes U = 1 there).
    assert set(times) == set(registry.names()) - {"ulysses"} and TOY in times
    cfg = CPConfig(algo="auto", cp_size=3, seq_length=12 * 1024 + 3, heads=8, kv_heads=2)  # only cyclic fits
    assert cfg.algo in (TOY, "attention2d-no", "attention2d-o") and TOY in cfg.predicted
    assert parse_args([*TINY, "--context-parallel-algo", TOY]).context_parallel_algo == TOY
    assert plan.main([*TINY, "--context-parallel-algo", TOY, "--gpus", "2", "--gpu-mem", "80"]) == 0
    out = capsys.readouterr().out
    assert "fits: " in out and "none of these layouts" not in out, out
