"""The cost model: its bytes equal the algorithms' byte counters on gloo; its times, fitted on one set of
measurements and checked on another (docs/results/cost_model_measured.json); its picks are sensible; `auto`
resolves through the Megatron flags; the reports (megatron-cp-bench cost-model); bad input raises."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import megatron_cp_plugin as mcp
from megatron_cp_plugin import cost as cm
from megatron_cp_plugin.algos import registry
from megatron_cp_plugin.bench.cost_report import attention_problem, fit_link, load_measured, log_errors
from megatron_cp_plugin.bench.cost_report import main as report_main
from megatron_cp_plugin.cost import HARDWARE, DecodeProblem, Hardware, Problem, choose_algo

DTYPES = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


# ------------------------------------------------------------------------------------- bytes vs CommStats
def _counted(rank, world, cases):
    """(forward, backward) CommStats bytes of each case: (algo, grid (R, C, gpus_per_node) or None, e, h, h_kv,
    d, b, tokens per rank, causal)."""
    from megatron_cp_plugin.cp_grid import get_grid

    out = []
    for algo, grid, e, h, hk, d, b, s_l, causal in cases:
        g = torch.Generator().manual_seed(len(out))
        seq = s_l * world
        q, do = (torch.randn(b, seq, h, d, generator=g).to(DTYPES[e]) for _ in range(2))
        k, v = (torch.randn(b, seq, hk, d, generator=g).to(DTYPES[e]) for _ in range(2))
        group = get_grid(dist.group.WORLD, grid[:2], gpus_per_node=grid[2]) if grid else None
        shard = lambda t: mcp.shard_sequence(t, algo=algo).detach()  # noqa: E731
        ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
        stats = mcp.CommStats()
        o = mcp.context_parallel_attention(ql, kl, vl, algo=algo, group=group, causal=causal, comm_stats=stats)
        o.backward(shard(do))
        out.append((stats.forward_bytes, stats.backward_bytes))
    return out


def _model(world, case, rank):
    algo, grid, e, h, hk, d, b, s_l, causal = case
    pb = Problem(s_l * world, world, h, hk, d, b, e, causal, grid=grid[:2] if grid else None)
    return cm.comm_bytes(algo, pb, gpus_per_node=grid[2] if grid else None, rank=rank)


# (P, cases): MHA and GQA, bf16 / fp32 / fp64 (fp64 accumulators), causal or not, batch and head dims, square
# and rectangular grids both ways, column-major (K, V permuted) and node-aware row-major placement; ulysses with
# K, V groups straddling two members (6 / 3 heads over 2: 2 K, V heads each) and member counts that differ (12 / 3
# over 4: 1, 2, 2, 1, so each rank sends its own count).
BYTE_CASES = {
    2: [("ring", None, 2, 4, 4, 8, 1, 6, True), ("burst", None, 4, 8, 2, 16, 2, 4, False),
        ("burst", None, 8, 4, 1, 8, 1, 2, True), ("attention2d-no", None, 2, 4, 4, 8, 1, 6, True),
        ("attention2d-o", (2, 1, None), 4, 8, 2, 8, 2, 3, True),
        ("attention2d-no", (1, 2, 2), 8, 4, 2, 8, 1, 4, False),
        ("allgather", None, 8, 4, 2, 8, 1, 4, True), ("ulysses", None, 4, 4, 1, 8, 2, 2, False),
        ("ulysses-ring", (2, 1, None), 2, 4, 2, 8, 1, 4, True), ("ulysses", None, 2, 6, 3, 8, 2, 2, True)],
    4: [("ring", None, 4, 8, 2, 8, 2, 4, True), ("burst", None, 2, 4, 4, 16, 1, 6, True),
        ("attention2d-no", (2, 2, None), 2, 8, 2, 8, 1, 5, True),
        ("attention2d-o", (2, 2, None), 4, 4, 4, 8, 2, 3, False),
        ("attention2d-no", (2, 2, 2), 4, 4, 4, 8, 1, 3, True), ("attention2d-o", (2, 2, 4), 2, 8, 2, 16, 1, 3, True),
        ("attention2d-o", (1, 4, None), 4, 4, 1, 8, 1, 3, True),
        ("attention2d-no", (4, 1, None), 8, 8, 2, 8, 1, 2, True),
        ("allgather", None, 2, 8, 2, 16, 2, 4, False), ("ulysses", None, 4, 8, 2, 8, 1, 4, True),
        ("ulysses-ring", (2, 2, None), 8, 4, 2, 8, 1, 4, True), ("ulysses-ring", None, 2, 8, 8, 8, 2, 2, False),
        ("ulysses", None, 4, 12, 3, 8, 1, 4, False), ("ulysses-ring", (2, 2, None), 2, 6, 3, 8, 2, 2, True)],
}


@pytest.mark.parametrize("world", sorted(BYTE_CASES))
def test_model_bytes_equal_comm_stats(pools, world):
    cases = BYTE_CASES[world]
    counted = pools(world).run(_counted, cases, timeout=120)
    for rank, got in enumerate(counted):
        for case, c in zip(cases, got):
            assert c == _model(world, case, rank), (world, rank, case)
            assert c[0] > 0 and c[1] > 0
    # The column-major 2 x 2 grid moves the K, V of ranks 1 and 2 only; the row-major one moves none.
    if world == 4:
        perm = [got[2][0] for got in counted]
        assert perm[1] == perm[2] > perm[0] == perm[3]
        assert len({got[4][0] for got in counted}) == 1
        # ulysses 12 / 3 over 4: the members with 2 K, V heads receive more of them, so send fewer (forward) and
        # return more dK, dV partials (backward) than those with 1.
        fwd, bwd = zip(*(got[12] for got in counted))
        assert fwd[0] == fwd[3] > fwd[1] == fwd[2] and bwd[0] == bwd[3] < bwd[1] == bwd[2]


def _decode_counted(rank, world, cases):
    """Bytes sent by one tree_decode / ring_decode call, counted at the torch.distributed calls with comm.py's
    convention (all-reduce 2 (g-1)/g of the buffer, all-gather (g-1) inputs, p2p the sent tensors)."""
    from unittest import mock

    from megatron_cp_plugin import comm
    from megatron_cp_plugin.algos.ring_decode import ring_decode

    sent = [0]
    nb = lambda t: t.numel() * t.element_size()  # noqa: E731
    real_ar, real_ag, real_p2p = dist.all_reduce, comm._ALL_GATHER, dist.batch_isend_irecv

    def all_reduce(t, *a, **kw):
        sent[0] += 2 * (world - 1) * nb(t) // world
        return real_ar(t, *a, **kw)

    def all_gather(out, inp, *a, **kw):
        sent[0] += (world - 1) * nb(inp)
        return real_ag(out, inp, *a, **kw)

    def batch(ops):
        sent[0] += sum(nb(op.tensor) for op in ops if op.op is dist.isend)
        return real_p2p(ops)

    out = []
    with mock.patch.object(dist, "all_reduce", all_reduce), mock.patch.object(comm, "_ALL_GATHER", all_gather), \
            mock.patch.object(dist, "batch_isend_irecv", batch):
        for method, e, h, hk, d, b, n_q, s_l, positions in cases:
            g = torch.Generator().manual_seed(3)
            q = torch.randn(b, n_q, h, d, generator=g).to(DTYPES[e])
            k, v = (torch.randn(b, s_l, hk, d, generator=g).to(DTYPES[e]) for _ in range(2))
            sent[0] = 0
            if method == "ring-decode":
                pos = (torch.arange(s_l) + rank * s_l).expand(b, s_l).contiguous() if positions else None
                ring_decode(q, k, v, kv_positions=pos)
            else:
                mcp.tree_decode(q, k, v, variant=method.split("-")[1], validate=False)
            out.append(sent[0])
    return out


DECODE_CASES = [("tree-allreduce3", 4, 8, 2, 16, 2, 1, 5, False), ("tree-allreduce2", 4, 4, 4, 8, 1, 3, 4, False),
                ("tree-allgather", 8, 8, 2, 8, 2, 2, 3, False), ("tree-allreduce2", 8, 8, 8, 8, 1, 1, 3, False),
                ("ring-decode", 4, 8, 2, 16, 2, 1, 5, False), ("ring-decode", 8, 4, 1, 8, 1, 1, 4, True),
                ("ring-decode", 2, 4, 2, 8, 1, 1, 6, False)]


@pytest.mark.parametrize("world", (2, 4))
def test_decode_bytes_equal_counted(pools, world):
    for rank, got in enumerate(pools(world).run(_decode_counted, DECODE_CASES, timeout=120)):
        for (m, e, h, hk, d, b, n_q, s_l, positions), c in zip(DECODE_CASES, got):
            pb = DecodeProblem(s_l * world, world, h, hk, d, b, n_q, e, positions)
            assert c == cm.decode_bytes(m, pb) > 0, (world, rank, m, c)


def test_bytes_match_the_papers_volumes():
    """burst-attention.txt Table 1 (volume summed over ranks, in elements, equal element sizes: forward 2BZNd,
    backward ring 4BZNd with K, V, dK, dV, burst 3BZNd + 2BNZ) and attention2d.txt Sec. 3.3 (per-rank volume
    falling like 1/sqrt(P) at fixed N)."""
    N, b, h, d, P = 4096, 1, 8, 64, 8
    pb = Problem(N, P, h, head_dim=d, dtype_bytes=4)
    ring, burst = cm.comm_bytes("ring", pb), cm.comm_bytes("burst", pb)
    per = lambda x: x * P // (P - 1) // 4  # noqa: E731 - all ranks' elements, per P - 1 ring steps
    assert per(ring[0]) == per(burst[0]) == 2 * b * h * N * d
    assert per(ring[1]) == 4 * b * h * N * d
    assert per(burst[1]) == 3 * b * h * N * d + 2 * b * N * h
    a2d = [sum(cm.comm_bytes("attention2d-no", Problem(N * 4, r * r, h, grid=(r, r)), gpus_per_node=r))
           for r in (2, 4, 8)]
    assert a2d[0] > a2d[1] > a2d[2] and 0.4 < a2d[2] / a2d[1] < 0.6      # (sqrt(P) - 1) / P chunks


# ------------------------------------------------------------------------------------- predictions
# The measured figures: data of the repository, next to these tests (the installed package predicts without them).
MEASURED = Path(__file__).resolve().parents[1] / "docs" / "results" / "cost_model_measured.json"


def _set(name):
    data = load_measured(MEASURED)
    return next(s for s in data["attention"] + data["decode"] if s["name"] == name)


def test_measured_figures_match_their_sources():
    """Every figure of cost_model_measured.json equals (to the 4 digits kept) the row of the docs/results file its
    set names, so the reports and the checks below compare with what the benchmarks wrote."""
    root = MEASURED.parents[2]
    data = load_measured(MEASURED)
    checked = 0
    for s in data["attention"] + data["decode"]:
        if not s["source"].endswith(".json"):
            continue                                    # issue 17's figures: quoted in the issue, no file kept
        src = json.loads((root / s["source"]).read_text())
        assert src["command"] == s["command"], s["name"]
        for r in s["rows"]:
            if "algo" in r:
                key, want = ("S", "algo", "P"), (r["seq_len"], r["algo"], s["world"])
                cols = ("fwd_ms", "fwd_bwd_ms")
            else:
                name = r["method"].replace("tree-", "tree ") + (" (CUDA graph)" if r["graphed"] else "")
                key, want, cols = ("context", "method", "P"), (r["context"], name, s["world"]), ("layer_us",)
            row = next(x for x in src["rows"] if tuple(x[k] for k in key) == want)
            pairs = [(r[c], row[c]) for c in cols]
            for kept, exact in pairs:
                assert kept == pytest.approx(exact, rel=1e-3), (s["name"], r)
                checked += 1
    assert checked >= 80


def test_nvlink_predictions_are_checks_nothing_fitted(monkeypatch):
    """h200-nvlink has no parameter fitted to any attention timing (its bandwidths, latency and kernel rates are
    micro-benchmark figures, docs/design.md), so every NVLink set is a check: P = 2 at 32k and 128k, a rerun of
    the 128k half, P = 4 at 128k, and P = 2 at 128k with every algorithm after issue 34's kernels (there every
    fwd+bwd within 10%: -4% ring to -10% ulysses-ring), and the same on 2 x H100 (the H200 preset standing in: one
    H100 ran the whole 128k in 458 ms, one H200 in 453) after the fused merge (-5% to -12%), and on 2 x H200 again at
    the thirteenth session's code (-5% to -9%) and the twenty-first's (ulysses' forward by halves; -6% to -8%).
    Tolerance, one-sided: the kernel rates are the single-kernel cuDNN rates
    at 16k-64k and the model leaves out the fall-off on the smaller per-step blocks and the SMs NCCL's copy
    kernels take, so it may only be low: by up to 15% at 128k (where the kernel alone ran 562 / 535 TFLOP/s
    against the preset's 600 / 566, 6% of it) and 25% at 32k (the smallest blocks); +5% above allows the
    run-to-run spread (the two 128k runs at P = 2 differ by up to 2%). The forward alone may be up to 7% high: the
    compute factor is fitted on fwd+bwd, and Attention2D-NO's forward on a 2 x 1 grid costs relatively less than its
    backward (with the 2026-11-26 H100 refit, fwd +6.3% where fwd+bwd is -4%)."""
    hw = HARDWARE["h200-nvlink"]
    # No set ran ulysses' head chunks (on from the nineteenth session to the twentieth, never measured in a set)
    from megatron_cp_plugin.algos import ulysses
    monkeypatch.setattr(ulysses, "PIPELINE_MIN_BYTES", 1 << 62)
    for name in ("nvlink-p2", "nvlink-p2-rerun", "nvlink-p4", "nvlink-p2-issue34", "nvlink-p2-h100-issue34",
                 "nvlink-p2-h200-issue34-s13", "nvlink-p2-h200-issue34-s21"):
        s = _set(name)
        for r in s["rows"]:
            p = cm.predict(r["algo"], attention_problem(s, r["seq_len"], r["algo"]), hw)
            low = -0.25 if r["seq_len"] <= 32768 else -0.15
            for pred, meas, high in ((p.fwd_s * 1e3, r["fwd_ms"], 0.07), (p.total_s * 1e3, r["fwd_bwd_ms"], 0.05)):
                assert low < pred / meas - 1 < high, (name, r, pred)
    # P = 4 over NVLink: ring and burst ahead of both Attention2D variants, as measured; auto picks one of them.
    s = _set("nvlink-p4")
    meas = {r["algo"]: r["fwd_bwd_ms"] for r in s["rows"]}
    pb = attention_problem(s, 131072)
    best, pred = choose_algo(pb, hw, MEASURED_ALGOS)
    for t in (meas, pred):
        assert max(t["ring"], t["burst"]) < min(t["attention2d-no"], t["attention2d-o"])
    assert best in ("ring", "burst")


def test_sockets_link_fitted_on_32k_checks_128k():
    """Fit on one set, check on another. Fitted: h200-sockets' two link parameters, the bandwidth (intra = inter)
    and p2p_ratio, by least squares on log time over the 8 figures at S = 32k (P = 2, fwd and fwd+bwd of the four
    algorithms, docs/results/cp_attention_slowlink.json), the rest of the preset kept. Checked: the 8 figures at
    S = 128k, which the fit never sees; there the compute (not fitted: cuDNN rates) is a quarter to a third of
    the time instead of 6-9%, so the check tests how the model combines fitted transfers with compute.
    Tolerance 20%: the measured transfer rates vary between algorithms and lengths by 3.7-4.1 GB/s (collectives)
    and 2.0-2.4 GB/s (p2p), i.e. +-5% and +-9% (cost/hardware.py), and the compute carries the NVLink sets'
    0-10% kernel-rate error at 128k. The measured fwd+bwd ranking at 128k must also come out.
    The shipped preset was fitted on all 16 figures (docs/cost_model.md), so its errors are in-sample: it is held
    to 15% on both halves, and the 32k-only refit must land within 10% of it (the preset is not tuned to the check
    half)."""
    s = _set("sockets-p2")
    fit = [r for r in s["rows"] if r["seq_len"] == 32768]
    check = [r for r in s["rows"] if r["seq_len"] == 131072]
    assert len(fit) == len(check) == 4
    preset = HARDWARE["h200-sockets"]
    refit = fit_link(preset, s, fit)
    assert max(abs(e) for e in log_errors(refit, s, fit)) < 0.05                  # the fit itself worked
    assert all(abs(math.exp(e) - 1) < 0.2 for e in log_errors(refit, s, check))           # out of sample
    assert all(abs(math.exp(e) - 1) < 0.15 for e in log_errors(preset, s, fit + check))   # in-sample
    assert abs(refit.intra_bw / preset.intra_bw - 1) < 0.1 and abs(refit.p2p_ratio / preset.p2p_ratio - 1) < 0.1
    pb = attention_problem(s, 131072)
    pred = {r["algo"]: cm.predict(r["algo"], pb, refit).total_s for r in check}
    meas = {r["algo"]: r["fwd_bwd_ms"] for r in check}
    assert sorted(pred, key=pred.get) == sorted(meas, key=meas.get) == [
        "attention2d-no", "burst", "attention2d-o", "ring"]


MEASURED_ALGOS = ("ring", "burst", "attention2d-no", "attention2d-o")
"""The algorithms docs/results' GPU measurements cover (issue 27's allgather, ulysses, ulysses-ring not yet): the
picks below that stand on those measurements are among them."""


def test_choose_algo_picks():
    # 2 GPUs over NVLink: compute-bound, every prediction within the model's tie (cm.ALGO_TIME_TIE), so the
    # registry's first, ring, the zigzag ring family measured fastest there (Attention2D-NO the slowest, 1-3 % behind,
    # and predicted 0.4 % ahead of ring with the fit of 2026-11-29).
    assert set(choose_algo(Problem(131072, 2, 16), HARDWARE["h200-nvlink"])[1]) == set(mcp.ALGORITHMS)
    for cands in (None, MEASURED_ALGOS, ("attention2d-no", "burst")):
        name, times = choose_algo(Problem(131072, 2, 16), HARDWARE["h200-nvlink"], cands)
        assert max(times.values()) < min(times.values()) * (1 + cm.ALGO_TIME_TIE) and all(t > 0 for t in times.values())
        assert name == (cands or registry.names())[0], (name, times)
    # P = 16 over slow inter-node links (16 single-GPU Ethernet nodes, or 4 nodes of 4 A100 with a NIC per
    # GPU): Attention2D. With one NIC shared by the 4 A100 of a node, every Attention2D rank's column traffic
    # queues for it while ring's single crossing per node has it alone: burst wins there.
    a100 = HARDWARE["a100-pcie"]
    for hw in (HARDWARE["h100-eth"], dataclasses.replace(a100, nics_per_node=None)):
        name, times = choose_algo(Problem(262144, 16, 32), hw, MEASURED_ALGOS)
        assert name.startswith("attention2d") and times[name] < 0.7 * times["ring"], (hw, times)
    assert choose_algo(Problem(262144, 16, 32), a100, MEASURED_ALGOS)[0] == "burst"
    # GQA (h / h_kv = 4) over a slow link: ring's K, V are 4x smaller than burst's Q, dO; Attention2D on its
    # fastest grid, 4 x 1 (K, V all-gathered, dK, dV partials summed at their owner in bf16, by collectives),
    # beats ring's fp32 dK, dV ring.
    pb = Problem(131072, 4, 32, 8)
    name, times = choose_algo(pb, HARDWARE["h200-sockets"], MEASURED_ALGOS)
    assert name == "attention2d-no" and cm.best_grid(name, pb, HARDWARE["h200-sockets"]) == (4, 1)
    assert times[name] < times["ring"] < times["burst"] / 1.5
    # The fwd-only objective, the attention2d variants alone, and a length only the cyclic layout can shard.
    name, times = choose_algo(Problem(131072, 2, 16, backward=False), HARDWARE["h200-sockets"],
                              ("attention2d-no", "attention2d-o"))
    assert name == "attention2d-no" and set(times) == {"attention2d-no", "attention2d-o"}
    name, times = choose_algo(Problem(12, 4, 4), HARDWARE["h200-nvlink"])             # 12 % 8 != 0
    assert set(times) == {"attention2d-no", "attention2d-o"}


def test_auto_chooses_the_collective_algorithms():
    """Issue 27: all-to-all over heads sends (U - 1) / U of a few tensors where the ring sends P - 1 K, V shards,
    so where the heads divide the model picks ulysses inside a node and ulysses-ring (all-to-all inside, ring
    across) beyond; where they do not, ulysses is left out and ulysses-ring takes a grid the heads allow.
    Predictions only: none of the three is measured on GPUs yet."""
    nv, ib = HARDWARE["h200-nvlink"], HARDWARE["h100-ib"]
    name, times = choose_algo(Problem(131072, 8, 32, 8), nv)
    assert name == "ulysses" and times[name] < min(times[a] for a in MEASURED_ALGOS)
    # 4 heads over 8 ranks: compute-bound, ulysses-ring within 2 % of the best (with the measured compute factors of
    # configs/rank_compute.json, ring's 1.0 at P = 4-16 makes it 1 % faster: 14.11 against 14.26 ms).
    name, times = choose_algo(Problem(131072, 8, 4, 4), nv)
    assert "ulysses" not in times and times["ulysses-ring"] <= 1.02 * times[name]
    assert cm.best_grid("ulysses-ring", Problem(131072, 8, 4, 4), nv) == (2, 4)
    pb = Problem(131072, 64, 32, 8)                                        # 8 nodes: no all-to-all over 64
    name, times = choose_algo(pb, ib)
    # 0.62x Attention2D-O with the H200 fit of 2026-11-28 (its P = 64 factor 1.04; 0.59x with the H100's 1.09)
    assert "ulysses" not in times and name == "ulysses-ring" and times[name] < 0.65 * times["attention2d-o"]
    R, U = cm.best_grid(name, pb, ib)
    assert R * U == 64 and 32 % U == 0 and 1 < U < 64
    # The heads a grid's all-to-all cannot split predict no time at all, never a choice.
    bad = cm.predict("ulysses-ring", dataclasses.replace(pb, grid=(1, 64)), ib)
    assert bad.total_s == float("inf") and (bad.fwd_bytes, bad.bwd_bytes) == (0, 0)


def test_best_grid_is_the_fastest_predicted_and_prefers_bytes_in_a_tie():
    nv, ib = HARDWARE["h200-nvlink"], HARDWARE["h100-ib"]
    pb = Problem(131072, 4, 32, 8)                     # GQA 32/8: choose_grid's square moves 4x more Q than K, V
    g = cm.best_grid("attention2d-no", pb, nv)
    secs = {r: cm.predict("attention2d-no", dataclasses.replace(pb, grid=(r, 4 // r)), nv).total_s for r in (1, 2, 4)}
    assert g == (4, 1) != mcp.choose_grid(4, h=32, h_kv=8) and secs[4] == min(secs.values())
    assert cm.best_grid("attention2d-no", dataclasses.replace(pb, grid=(2, 2)), nv) == (2, 2)   # given: kept
    # Compute-bound (P = 16 on 8-GPU IB nodes, 1M, MHA): 16 x 1 (its gathers hidden behind the own pair's compute,
    # attention2d.pair_order, its dK, dV exchange behind the own pair's last keys, attention2d.own_split) 1.8 %
    # ahead of 4 x 4, every grid but 8 x 2 (5.1 %) within cost.model.GRID_TIME_TIE of it; within the tie the fewest
    # bytes win (4 x 4: 21 GB a fwd+bwd against 16 x 1's 48), not the fastest.
    pb = Problem(1048576, 16, 32)
    preds = {r: cm.predict("attention2d-no", dataclasses.replace(pb, grid=(r, 16 // r)), ib) for r in (1, 2, 4, 8, 16)}
    fastest = min(p.total_s for p in preds.values())
    assert all(p.total_s < (1 + cm.model.GRID_TIME_TIE) * fastest for r, p in preds.items() if r != 8)
    assert preds[16].total_s == fastest < preds[4].total_s
    assert min(preds, key=lambda r: preds[r].fwd_bytes + preds[r].bwd_bytes) == 4
    assert cm.best_grid("attention2d-no", pb, ib) == (4, 4)
    # auto and attention2d run the algorithm on the grid its time was predicted for.
    from megatron_cp_plugin.megatron.args import CPConfig
    cfg = CPConfig(algo="attention2d", cp_size=4, seq_length=131072, heads=32, kv_heads=8)
    assert cfg.algo.startswith("attention2d") and cfg.grid == (4, 1) and "grid 4x1" in cfg.choice_line()


def test_scaling_shape():
    """Fixed N: per-rank attention2d bytes fall with P, ring's stay flat; over a slow link that makes
    attention2d scale where ring does not (attention2d.txt Sec. 4.2)."""
    hw = HARDWARE["h100-eth"]
    ring = [cm.predict("ring-te", Problem(262144, P, 32), hw) for P in (16, 64)]
    a2d = [cm.predict("attention2d-no", Problem(262144, P, 32), hw) for P in (16, 64)]
    assert ring[1].fwd_bytes + ring[1].bwd_bytes >= ring[0].fwd_bytes + ring[0].bwd_bytes
    # ring's own: fp32 dK, dV on the neighbour ring (16k tokens a rank), the input dtype in rounds (4k): ring-te's
    own = [cm.comm_bytes("ring", Problem(262144, P, 32)) for P in (16, 64)]
    assert 3 * sum(own[0]) == 4 * (ring[0].fwd_bytes + ring[0].bwd_bytes)
    assert sum(own[1]) == ring[1].fwd_bytes + ring[1].bwd_bytes
    assert a2d[1].fwd_bytes + a2d[1].bwd_bytes < 0.6 * (a2d[0].fwd_bytes + a2d[0].bwd_bytes)
    assert a2d[1].total_s < 0.6 * a2d[0].total_s and ring[1].total_s > 0.8 * ring[0].total_s
    # Node-aware placement: an 8 x 8 grid on 8-GPU nodes keeps rows (Q, dO, fp32 o and dQ partials) on NVLink
    # and sends columns (K, V, bf16 dK, dV partials) over InfiniBand, but its rows hold consecutive residues, so
    # line 5 stays one call per chunk pair (64 calls, 56 merges), where the column-major placement runs groups of
    # n = 4 chunks (4 calls of 4 x 4 pairs, 8 merges of 4 chunks' rows). With the fused merge (10 bytes an element)
    # and the measured factors (configs/rank_compute.json, one H100): with GQA (columns 4x smaller) the links win,
    # node-aware 19 % faster; with MHA the grouped calls do, node-aware 3.5 % slower.
    ib = HARDWARE["h100-ib"]
    aware, col = (cm.predict("attention2d-no", Problem(262144, 64, 32, 8, node_aware=na), ib) for na in (True, False))
    assert aware.row_major and not col.row_major and 0.75 < aware.total_s / col.total_s < 0.87
    aware, col = (cm.predict("attention2d-no", Problem(262144, 64, 32, node_aware=na), ib) for na in (True, False))
    assert 1.0 < aware.total_s / col.total_s < 1.1


def test_decode_tree_beats_ring_and_one_gpu_at_long_context():
    hw = HARDWARE["h100-ib"]
    for P in (8, 128):
        dp = DecodeProblem(5_120_000, P, 16)
        best, t = cm.choose_decode(dp, hw)
        assert best.startswith("tree") and t["ring-decode"] > 8 * t[best]
    one = cm.predict_decode("tree-allreduce2", DecodeProblem(1 << 20, 1, 32, 8), HARDWARE["h200-nvlink"])
    eight = cm.predict_decode("tree-allreduce2", DecodeProblem(1 << 20, 8, 32, 8), HARDWARE["h200-nvlink"])
    assert eight < one / 3
    # Bytes: tree moves one (o, lse) per query, independent of the context; ring the whole cache.
    small, big = (cm.decode_bytes("tree-allreduce2", DecodeProblem(S, 8, 32, 8)) for S in (1024, 1 << 20))
    ring = cm.decode_bytes("ring-decode", DecodeProblem(1 << 20, 8, 32, 8))
    assert small == big and ring == 7 * (1 << 17) * 8 * 128 * 4           # 7 shards of K, V, bf16


def test_cli_prints_and_writes_tables(capsys, tmp_path):
    stem = tmp_path / "out" / "cost_model"
    assert report_main(["--table", "measured", "node8", "decode", "--measured", str(MEASURED), "--out", str(stem)]) == 0
    out = capsys.readouterr().out
    assert "| 2 | 128k | attention2d-no | 1x2 |" in out and "| 8 | 512k | 32/8 |" in out and "ring-decode" in out
    assert "| 32k | ring | - | 55.9 |" in out and "| check |" in out
    assert stem.with_suffix(".md").read_text() == out
    res = json.loads(stem.with_suffix(".json").read_text())
    assert set(res["tables"]) == {"measured", "node8", "decode"} and res["device"].startswith("none")
    assert res["tables"]["node8"][0]["rows"][0]["P"] == 4
    assert report_main(["--seq", "65536", "--cp", "4", "--heads", "16", "--kv-heads", "4", "--grid", "4x1"]) == 0
    assert "choose_algo: " in capsys.readouterr().out
    with pytest.raises(SystemExit):
        report_main([])
    assert "give --table or --seq" in capsys.readouterr().err


def test_reports_without_the_measured_data(monkeypatch, tmp_path):
    """An installed package has no docs/: the model-only tables work, the measured one says where the data is."""
    from megatron_cp_plugin.bench import cost_report

    monkeypatch.setattr(cost_report, "MEASURED_PATH", tmp_path / "docs" / "results" / "cost_model_measured.json")
    assert cost_report.table_node8() and cost_report.table_decode()
    with pytest.raises(FileNotFoundError, match="cost_model_measured.json.*--measured"):
        cost_report.table_measured()
    with pytest.raises(SystemExit, match="measured figures not found"):
        report_main(["--table", "measured"])


def test_scale_and_bytes_tables_render(capsys):
    """Issue 16: the scale table (P = 16-64, 100-400 Gb/s, against ring-te, beside the paper's Sec. 4 claims)
    and the bytes table render; ring-te sends dK, dV in the input dtype (ring's bf16 bytes are 4/3 of its)."""
    assert report_main(["--table", "scale", "bytes"]) == 0
    out = capsys.readouterr().out
    assert "| P | link Gb/s | h/h_kv | N | ring-te ms | ring | burst | attention2d-no | attention2d-o | grid |" in out
    for P, gbps in ((16, 100), (32, 200), (64, 400)):
        assert f"| {P} | {gbps} | 32/8 | 1M |" in out
    assert out.count("Sec. 4.") >= 3 and "| 4 | 2x2 | 1.333 | 1.005 |" in out
    # rounds (8k a rank): ring's dK, dV partials and burst's dQ partials in the input dtype (burst's were fp32: 1.005)
    assert "| 16 | 4x4 | 1.000 | 0.839 |" in out
    pb = Problem(131072, 8, 32, dtype_bytes=2)
    f_te, b_te = cm.comm_bytes("ring-te", pb)
    assert b_te == 2 * f_te and sum(cm.comm_bytes("ring", pb)) * 3 == 4 * (f_te + b_te)


# What the wire-precision policy (docs/design.md) reaches at P = 4 / 16 / 64: 0.836 / 0.468 / 0.251 of ring-te's
# bytes. Issue 16's targets (<= 0.78 / 0.45 / 0.25, BYTES_TARGETS) assumed bf16 o and dQ partials, which the
# policy rejects for precision (rule 3); this guards what the code sends and that it is below the pre-issue
# 0.95 / 0.54 / 0.29.
REACHED = {4: 0.837, 16: 0.469, 64: 0.252}


@pytest.mark.parametrize("world", [4, 16, 64])
def test_attention2d_no_bytes_against_ring_te(world):
    """attention2d-no's mean bytes per rank per fwd+bwd over ring-te's (2x2, 4x4, 8x8 column-major, MHA, bf16,
    128k), the mean over ranks as comm_bytes gives each."""
    from megatron_cp_plugin.bench import cost_scale

    (R, C), target, before = cost_scale.BYTES_TARGETS[world]
    pb = Problem(131072, world, 32, grid=(R, C), node_aware=False)
    per_rank = [sum(cm.comm_bytes("attention2d-no", pb, rank=r)) for r in range(world)]
    assert min(per_rank) < max(per_rank)     # the permutation moves some ranks' K, V: the mean is not the max
    assert cost_scale.mean_bytes("attention2d-no", pb, None) == sum(per_rank) / world
    ratio = sum(per_rank) / world / cost_scale.mean_bytes("ring-te", pb, None)
    assert ratio <= REACHED[world] < before, (world, ratio, target)



def test_attention2d_o_runs_the_no_schedule_on_shards_up_to_8k():
    """Attention2D-O sends -NO's bytes on shards of 8k tokens or fewer (cp_grid.OVERLAP_MIN_LOCAL: at 128k over 16 its
    overlap cost more local work than it hid, one H100, twenty-third session) and its own multi-hop fp32 ring
    accumulators above (16k tokens: 256k over 16, 1M over 64)."""
    for n, P, own in ((131072, 16, False), (131072, 64, False), (262144, 16, True), (1048576, 64, True)):
        pb = Problem(n, P, 32)
        same = cm.comm_bytes("attention2d-o", pb) == cm.comm_bytes("attention2d-no", pb)
        assert same != own, (n, P)


def test_attention2d_no_times_its_gathers_behind_its_own_pairs():
    """Where every chunk pair is a call of its own (2 x 1 at P = 2), Attention2D-NO computes its own pair while its
    gathers travel (attention2d.pair_order): over sockets the model's fwd+bwd falls by 17 % against waiting for them
    first (Problem.a2d_no_waits, the measured sets before the twenty-third session), over NVLink by 1.5 %, the bytes
    unchanged; grouped chunks (4 x 4 at 8k tokens: n = 2) wait as before. Red with the overlap term removed."""
    for hw, cut in ((HARDWARE["h200-sockets"], 0.83), (HARDWARE["h200-nvlink"], 0.985)):
        pb = Problem(131072, 2, 16, grid=(2, 1))
        now, waited = (cm.predict("attention2d-no", dataclasses.replace(pb, a2d_no_waits=w), hw) for w in (False, True))
        assert (now.fwd_bytes, now.bwd_bytes) == (waited.fwd_bytes, waited.bwd_bytes)
        assert now.fwd_s < waited.fwd_s and now.bwd_s < waited.bwd_s
        assert now.total_s == pytest.approx(cut * waited.total_s, abs=0.01 * waited.total_s)
        pb = Problem(131072, 16, 32, grid=(4, 4), node_aware=False)
        assert cm.predict("attention2d-no", pb, hw) == cm.predict("attention2d-no", dataclasses.replace(
            pb, a2d_no_waits=True), hw)


def test_attention2d_no_times_its_dkv_exchange_behind_its_own_keys():
    """On an R x 1 grid (2 x 1 at P = 2, 4 x 1 at P = 4) Attention2D-NO's backward posts its dK, dV exchange before
    the own pair's keys [s1:] (attention2d.own_split): the model's backward falls against the exchange after the
    last pair (Problem.a2d_no_exchange_waits, every measured set before the twenty-fourth session) over NVLink, where
    the own pair outlasts the gather (1 % at 2 x 1, 3 % at 4 x 1), the forward and the bytes unchanged. Over
    sockets nothing changes: the gather alone outlasts the whole own pair, which hid under it before and now hides
    half under it and half under the exchange (the rest of both waits either way). Grids with a row of several
    chunks (2 x 2, 4 x 4) as before. Red with the overlap term removed."""
    for hw, cut in ((HARDWARE["h200-sockets"], (1.0, 1.0)), (HARDWARE["h200-nvlink"], (0.99, 0.97))):
        for pb, x in zip((Problem(131072, 2, 16, grid=(2, 1)), Problem(131072, 4, 16, grid=(4, 1), node_aware=False)),
                         cut):
            now, waited = (cm.predict("attention2d-no", dataclasses.replace(pb, a2d_no_exchange_waits=w), hw)
                           for w in (False, True))
            assert (now.fwd_bytes, now.bwd_bytes, now.fwd_s) == (waited.fwd_bytes, waited.bwd_bytes, waited.fwd_s)
            assert now.bwd_s == pytest.approx(x * waited.bwd_s, abs=0.005 * waited.bwd_s), (hw.name, pb.grid)
        for grid in ((2, 2), (4, 4)):
            pb = Problem(131072, grid[0] * grid[1], 32, grid=grid, node_aware=False)
            assert cm.predict("attention2d-no", pb, hw) == cm.predict("attention2d-no", dataclasses.replace(
                pb, a2d_no_exchange_waits=True), hw)

# ------------------------------------------------------------------------------------- Megatron flags
def _args(*flags, **shape):
    from megatron_cp_plugin.megatron.args import add_cp_args

    a = add_cp_args(argparse.ArgumentParser()).parse_args(list(flags))
    for k, v in dict(num_attention_heads=32, num_query_groups=None, hidden_size=4096, seq_length=131072,
                     context_parallel_size=8, micro_batch_size=1, bf16=True).items():
        setattr(a, k, shape.get(k, v))
    return a


def test_auto_resolves_through_args(capsys, monkeypatch):
    from megatron_cp_plugin.megatron import args as margs

    monkeypatch.setattr(margs, "_LOGGED", set())
    a = _args("--context-parallel-algo", "auto", "--cp-hardware", "h200-sockets")
    cfg = margs.config_from_args(a)
    want, times = choose_algo(Problem(131072, 8, 32, node_aware=False), HARDWARE["h200-sockets"])
    assert cfg.algo == want == margs.resolve_algo(a) and cfg.requested == "auto" and cfg.predicted == times
    lines = capsys.readouterr().out.strip().splitlines()                # logged once for two resolutions
    assert len(lines) == 1 and f"auto -> {want}" in lines[0] and "h200-sockets" in lines[0]
    # Megatron-LM's args: num_query_groups = 1 unless --group-query-attention; tensor parallelism splits heads.
    cfg = margs.config_from_args(_args("--context-parallel-algo", "auto", num_query_groups=1))
    assert (cfg.heads, cfg.kv_heads) == (32, 1)
    b = _args("--context-parallel-algo", "auto", num_query_groups=1)
    b.group_query_attention, b.tensor_model_parallel_size = False, 2
    cfg = margs.config_from_args(b)
    assert (cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.dtype_bytes) == (16, 16, 128, 2)
    # attention2d picks a variant; with --cp-grid auto picks among the attention2d variants too.
    assert margs.resolve_algo(_args("--context-parallel-algo", "attention2d")) in ("attention2d-no", "attention2d-o")
    cfg = margs.config_from_args(_args("--context-parallel-algo", "auto", "--cp-grid", "8x1"))
    assert set(cfg.predicted) == {"attention2d-no", "attention2d-o", "ulysses-ring"} and cfg.grid == (8, 1)
    # A length that zigzag cannot shard: auto still finds a cyclic algorithm.
    assert margs.resolve_algo(_args("--context-parallel-algo", "auto", seq_length=8 * 3)).startswith("attention2d")
    # A concrete algo is untouched and logs nothing.
    capsys.readouterr()
    assert margs.resolve_algo(_args("--context-parallel-algo", "burst")) == "burst" and not capsys.readouterr().out


def test_auto_bad_input():
    from megatron_cp_plugin.megatron.args import CPConfig

    with pytest.raises(ValueError, match="model shape"):
        CPConfig(algo="auto", cp_size=4)
    assert CPConfig(algo="attention2d", cp_size=4).algo == "attention2d-no"       # no shape: as before
    with pytest.raises(ValueError, match="--cp-hardware"):
        CPConfig(algo="auto", cp_size=4, seq_length=64, heads=4, hardware="tpu")
    with pytest.raises(ValueError, match="--seq-length"):
        CPConfig(algo="auto", cp_size=4, seq_length=66, heads=4)
    with pytest.raises(ValueError, match="--cp-grid"):
        CPConfig(algo="auto", cp_size=4, seq_length=64, heads=4, grid=(3, 1))
    with pytest.raises(ValueError, match="--context-parallel-algo"):
        CPConfig(algo="fastest", cp_size=4)
    with pytest.raises(SystemExit):
        _args("--cp-hardware", "tpu")


def test_the_group_cap_flag_is_checked_and_reaches_the_attention_layers():
    """--cp-group-tokens: a positive number of tokens, for the algorithms with grouped calls (auto may resolve to
    any); it reaches CPCoreAttention's parameters through the layer spec."""
    from megatron_cp_plugin.megatron import lm
    from megatron_cp_plugin.megatron.args import CPConfig, config_from_args

    for bad in (0, -5, True):
        with pytest.raises(ValueError, match="--cp-group-tokens must be a positive number of query tokens"):
            CPConfig(algo="attention2d-no", cp_size=4, group_tokens=bad)
    with pytest.raises(ValueError, match=r"--cp-group-tokens is for .*\(attention2d-no, attention2d-o\), not "
                                         "--context-parallel-algo ring"):
        CPConfig(algo="ring", cp_size=4, group_tokens=16384)
    assert CPConfig(algo="auto", cp_size=4, seq_length=65536, heads=16, group_tokens=16384).group_tokens == 16384
    a = _args("--context-parallel-algo", "attention2d-o", "--cp-group-tokens", "8192")
    assert config_from_args(a, log=False).group_tokens == 8192
    a.transformer_impl, a.num_experts, a.moe_grouped_gemm, a.qk_layernorm, a.normalization = "local", None, False, \
        False, "RMSNorm"
    spec = lm.layer_spec(a)
    assert spec.submodules.self_attention.submodules.core_attention.params["group_tokens"] == 8192


def test_bad_input_raises():
    hw = HARDWARE["h200-nvlink"]
    bad_problems = [dict(seq_len=100, world=3, heads=4), dict(seq_len=64, world=4, heads=6, kv_heads=4),
                    dict(seq_len=64, world=4, heads=4, dtype_bytes=3), dict(seq_len=64, world=4, heads=4, grid=(2, 3)),
                    dict(seq_len=64, world=0, heads=4), dict(seq_len=64, world=4, heads=4, batch=1.5)]
    for kw in bad_problems:
        with pytest.raises(ValueError, match="Problem"):
            Problem(**kw)
    for kw in (dict(intra_bw=-1), dict(inter_lat=float("nan")), dict(gpus_per_node=0), dict(nics_per_node=0)):
        with pytest.raises(ValueError, match="Hardware"):
            dataclasses.replace(hw, **kw)
    with pytest.raises(ValueError, match="DecodeProblem"):
        DecodeProblem(1024, 2, 6, 4)
    pb = Problem(64, 4, 4)
    with pytest.raises(ValueError, match="algo"):
        cm.predict("nope", pb, hw)
    with pytest.raises(ValueError, match="sharded"):
        cm.predict("ring", Problem(12, 4, 4), hw)
    with pytest.raises(ValueError, match="candidates"):
        choose_algo(pb, hw, ())
    with pytest.raises(ValueError, match="candidates"):
        choose_algo(pb, hw, ("ring", "nope"))
    with pytest.raises(ValueError, match="method"):
        cm.decode_bytes("tree", DecodeProblem(64, 2, 4))
    with pytest.raises(ValueError, match="rank"):
        cm.comm_bytes("ring", pb, rank=4)
    assert isinstance(hw, Hardware)


def test_measured_sets_record_the_grid_that_ran():
    """Of every grid of P, the one a set records for a grid algorithm (`attention_problem`: Attention2D the set's,
    ulysses-ring its default) gives the model's bytes nearest to what the benchmark counted in that run
    (MB_sent_fwd_bwd, MiB), so the model times the grid that ran; at P = 2 the bytes agree to 1%. (nvlink-p4 ran
    code whose Attention2D sent 1930 MiB where today's 2 x 2 sends 2182: nearest, not equal.) Five issue-34 sets
    had recorded 1 x 2 where Attention2D ran on 2 x 1 (1536 MiB counted; 1 x 2 sends 1804)."""
    root = MEASURED.parents[2]
    checked = 0
    for s in load_measured(MEASURED)["attention"]:
        if not s["source"].endswith(".json"):
            continue
        src = json.loads((root / s["source"]).read_text())
        P = s["world"]
        for r in s["rows"]:
            row = next(x for x in src["rows"] if (x["S"], x["algo"], x["P"]) == (r["seq_len"], r["algo"], P))
            if row.get("MB_sent_fwd_bwd") is None or not registry.get(r["algo"]).grid:
                continue
            pb = attention_problem(s, r["seq_len"], r["algo"])
            grids = [(a, P // a) for a in range(1, P + 1) if P % a == 0]
            sent = {g: sum(cm.comm_bytes(r["algo"], dataclasses.replace(pb, grid=g))) / 2 ** 20 for g in grids}
            ran = sum(cm.comm_bytes(r["algo"], pb)) / 2 ** 20
            nearest = min(sent.values(), key=lambda x: abs(x - row["MB_sent_fwd_bwd"]))
            assert ran == nearest, (s["name"], r["algo"], row["MB_sent_fwd_bwd"], sent)
            if P == 2:
                assert ran == pytest.approx(row["MB_sent_fwd_bwd"], rel=0.01), (s["name"], r["algo"])
            checked += 1
    assert checked >= 25
