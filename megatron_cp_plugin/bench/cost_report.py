"""`megatron-cp-bench cost-model`: the cost model's tables (docs/cost_model.md), or one problem's prediction.

    megatron-cp-bench cost-model --table measured papers node8 decode [--out results/cost_model]
    megatron-cp-bench cost-model --seq 131072 --cp 4 --heads 16 [--hardware h200-sockets]

measured  predictions against the measured figures of docs/results/cost_model_measured.json (read from the
          repository checkout, or --measured PATH): h200-nvlink (nothing fitted), h200-sockets (its preset, fitted
          on all its figures, and a refit on the 32k half checked on the 128k half), decode eager and graphed.
papers    the papers' settings (attention2d.txt Sec. 4.1, 4.3; tree-attention.txt Sec. 6.1) next to their claims.
node8     P = 4 and 8 on one 8 x H200 node: every algorithm, 128k-512k, MHA and GQA.
decode    decode on one 8 x H200 node, Llama-3.1-8B attention, P = 2, 4, 8.
scale     P = 16, 32, 64 over 100-400 Gb/s links, every algorithm against ring-te, and the attention2d paper's
          Sec. 4 claims beside the model's speed-ups (bench/cost_scale.py).
bytes     mean bytes per rank against ring-te at P = 4, 16, 64 (MHA, bf16, 128k) and issue 16's targets.
step      the P = 4 NVLink training step per algorithm (GPT-3 2.7B, 64k) beside the measured 2026-11-22 one, with
          each algorithm's compute factor from `megatron-cp-bench rank` (bench/cost_step.py).
--out STEM writes STEM.json (the rows, unformatted) and STEM.md (what is printed).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..algos.registry import names
from . import cost_scale, cost_step
from ..cost import (DECODE_METHODS, FA2_H100, HARDWARE, DecodeProblem, Hardware, Problem, choose_algo, predict,
                    predict_decode)

# The repository's docs/results, next to the package: the measured figures are data of the repository, not of
# the installed package, which imports and predicts without them.
MEASURED_PATH = Path(__file__).resolve().parents[2] / "docs" / "results" / "cost_model_measured.json"


def load_measured(path: str | os.PathLike | None = None) -> dict:
    """The measured figures (docs/results/cost_model_measured.json); a clear error where there is no checkout."""
    p = Path(path) if path is not None else MEASURED_PATH
    if not p.is_file():
        raise FileNotFoundError(f"cost model: measured figures not found at {p}; they live in the repository "
                                "(docs/results/cost_model_measured.json): run from a checkout or pass --measured PATH")
    with open(p) as f:
        return json.load(f)


def attention_problem(s: dict, seq_len: int, algo: str = "attention2d-no") -> Problem:
    """The Problem `algo` ran in a measured attention set: bench.cp_attention places Attention2D grids
    column-major, on the grid the set records (what ran then: the bytes the benchmark counted say which,
    tests/test_cost_model.py), else choose_grid's; the other grid algorithm, ulysses-ring, on its own default.
    `fp32_one_hop`: the set ran before one-hop accumulators travelled in the input dtype (Problem.fp32_one_hop);
    `a2d_no_waits`: before Attention2D-NO computed its own pair while its gathers travel (Problem.a2d_no_waits);
    `a2d_no_exchange_waits`: before its R x 1 backward hid the dK, dV exchange (Problem.a2d_no_exchange_waits)."""
    grid = tuple(s["attention2d_grid"]) if s.get("attention2d_grid") and algo.startswith("attention2d") else None
    return Problem(seq_len, s["world"], s["heads"], s["kv_heads"], s["head_dim"], s["batch"], s["dtype_bytes"],
                   s["causal"], grid=grid, node_aware=False, fp32_one_hop=s.get("fp32_one_hop", False),
                   a2d_no_waits=s.get("a2d_no_waits", False),
                   a2d_no_exchange_waits=s.get("a2d_no_exchange_waits", False))


def decode_problem(s: dict, context: int) -> DecodeProblem:
    return DecodeProblem(context, s["world"], s["heads"], s["kv_heads"], s["head_dim"], s["batch"], s["n_q"],
                         s["dtype_bytes"])


def log_errors(hw: Hardware, s: dict, rows) -> list[float]:
    """log(predicted / measured) of the forward and the fwd+bwd time of each row of set s."""
    out = []
    for r in rows:
        p = predict(r["algo"], attention_problem(s, r["seq_len"], r["algo"]), hw)
        out += [math.log(p.fwd_s * 1e3 / r["fwd_ms"]), math.log(p.total_s * 1e3 / r["fwd_bwd_ms"])]
    return out


def fit_link(base: Hardware, s: dict, rows) -> Hardware:
    """base with its link bandwidth (intra_bw = inter_bw) and p2p_ratio fitted to `rows` of set s: least squares on
    log time (fwd and fwd+bwd), by a coarse then a fine grid search (two parameters, smooth: no solver needed)."""
    def sse(bw, ratio):
        hw = dataclasses.replace(base, intra_bw=bw, inter_bw=bw, p2p_ratio=ratio)
        return sum(e * e for e in log_errors(hw, s, rows))

    bw, ratio, span = base.intra_bw, base.p2p_ratio, 4.0
    for _ in range(2):                   # x / span .. x * span in 20 steps each way, then one coarse step around
        grid = [span ** (i / 20) for i in range(-20, 21)]
        bw, ratio = min(((bw * a, ratio * b) for a in grid for b in grid), key=lambda x: sse(*x))
        span = span ** (1 / 20)
    return dataclasses.replace(base, intra_bw=bw, inter_bw=bw, p2p_ratio=ratio, name=base.name + " (refit)")


# ----------------------------------------------------------------------------------------------- formatting
@dataclass
class Table:
    title: str
    rows: list[dict]
    fmt: dict = field(default_factory=dict)
    """Column -> formatter for markdown; the JSON keeps the raw values."""

    def markdown(self) -> str:
        cols = list(dict.fromkeys(c for r in self.rows for c in r))
        out = [self.title, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in self.rows:
            out.append("| " + " | ".join(self.fmt.get(c, _cell)(r.get(c, "")) for c in cols) + " |")
        return "\n".join(out)


def _cell(v) -> str:
    return _ms(v) if isinstance(v, float) else str(v)


def _ms(t: float) -> str:
    return f"{t:.3g}" if t < 1000 else f"{t:.0f}"


def _k(n: int) -> str:
    return f"{n // 1048576}M" if n % 1048576 == 0 else f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _pct(x: float) -> str:
    return f"{x:+.0%}"


def _grid(p) -> str:
    return f"{p.grid[0]}x{p.grid[1]}" if p.grid else "-"


# ----------------------------------------------------------------------------------------------- measured
def table_measured(data: dict | None = None) -> list[Table]:
    """Predictions against the measured sets: every h200-nvlink set (nothing fitted), the sockets set with its
    preset (fitted on all of it) and a refit on the 32k half (the 128k half is then a check), decode."""
    data = load_measured() if data is None else data
    out = []
    rows = []
    for s in data["attention"]:
        if s["hardware"] != "h200-nvlink":
            continue
        for r in s["rows"]:
            p = predict(r["algo"], attention_problem(s, r["seq_len"], r["algo"]), HARDWARE["h200-nvlink"])
            pf, pt = p.fwd_s * 1e3, p.total_s * 1e3
            rows.append({"P": s["world"], "S": r["seq_len"], "algo": r["algo"], "grid": _grid(p),
                         "pred fwd": pf, "meas fwd": r["fwd_ms"], "err fwd": pf / r["fwd_ms"] - 1,
                         "pred fwd+bwd": pt, "meas fwd+bwd": r["fwd_bwd_ms"], "err fwd+bwd": pt / r["fwd_bwd_ms"] - 1,
                         "set": s["name"]})
    out.append(Table("h200-nvlink, nothing fitted (b = 1, h = h_kv = 16, d = 128, bf16, causal, column-major "
                     "grid as the benchmark; ms)", rows,
                     {"S": _k, "err fwd": _pct, "err fwd+bwd": _pct}))
    for s in data["attention"]:
        if s["hardware"] != "h200-sockets":
            continue
        preset = HARDWARE["h200-sockets"]
        fit_rows = [r for r in s["rows"] if r["seq_len"] == 32768]
        split = 0 < len(fit_rows) < len(s["rows"])       # a 32k half to fit on and a 128k half to check
        fit_rows = fit_rows if split else s["rows"]
        refit = fit_link(preset, s, fit_rows)
        rows = []
        for r in s["rows"]:
            pb = attention_problem(s, r["seq_len"], r["algo"])
            a, b = (predict(r["algo"], pb, hw) for hw in (preset, refit))
            rows.append({"S": r["seq_len"], "algo": r["algo"], "grid": _grid(a), "meas fwd": r["fwd_ms"],
                         "pred fwd (preset / refit)": (a.fwd_s * 1e3, b.fwd_s * 1e3),
                         "err fwd": (a.fwd_s * 1e3 / r["fwd_ms"] - 1, b.fwd_s * 1e3 / r["fwd_ms"] - 1),
                         "meas fwd+bwd": r["fwd_bwd_ms"],
                         "pred fwd+bwd (preset / refit)": (a.total_s * 1e3, b.total_s * 1e3),
                         "err fwd+bwd": (a.total_s * 1e3 / r["fwd_bwd_ms"] - 1, b.total_s * 1e3 / r["fwd_bwd_ms"] - 1),
                         "refit role": "fit" if r in fit_rows else "check"})
        pair = lambda f: lambda v: f"{f(v[0])} / {f(v[1])}"  # noqa: E731
        out.append(Table(
            f"h200-sockets ({s['name']}, {s['device']}: P = {s['world']}, b = 1, h = h_kv = 16, d = 128, bf16, "
            f"causal; ms). preset: {preset.intra_bw / 1e9:.2f} GB/s, p2p x{preset.p2p_ratio:.2f}, fitted on all 16 "
            f"figures of sockets-p2" + (" (in-sample)" if s["name"] == "sockets-p2" else " (another host)") +
            ". refit: the same two parameters fitted on " + ("the 32k rows alone" if split else "this set's rows") +
            f", {refit.intra_bw / 1e9:.2f} GB/s, p2p x{refit.p2p_ratio:.2f}" +
            ("; its 128k errors are out of sample" if split else " (in-sample)"), rows,
            {"S": _k, "pred fwd (preset / refit)": pair(_ms), "err fwd": pair(_pct),
             "pred fwd+bwd (preset / refit)": pair(_ms), "err fwd+bwd": pair(_pct)}))
    rows = []
    for s in data["decode"]:
        for r in s["rows"]:
            t = predict_decode(r["method"], decode_problem(s, r["context"]), HARDWARE[s["hardware"]],
                               graphed=r["graphed"]) * 1e6
            rows.append({"P": s["world"], "context": r["context"], "method": r["method"],
                         "mode": "graph" if r["graphed"] else "eager", "pred us": t, "meas us": r["layer_us"],
                         "pred / meas": t / r["layer_us"], "set": s["name"]})
    rows.sort(key=lambda r: (r["P"], r["mode"], r["context"], DECODE_METHODS.index(r["method"])))
    us = lambda v: f"{v:.0f}"  # noqa: E731
    out.append(Table("h200-nvlink decode (h = 32, h_kv = 8, d = 128, b = 1, 1 token, bf16; us per layer, from 32 "
                     "layers back to back)", rows,
                     {"context": _k, "pred us": us, "meas us": us, "pred / meas": lambda v: f"{v:.2f}"}))
    return out


# ----------------------------------------------------------------------------------------------- papers
def _node_aware_best(pb: Problem, hw: Hardware) -> Problem:
    """pb on the grid, among those whose columns fit in a node (row-major placement), that the model likes best."""
    grids = [(pb.world // c, c) for c in range(1, hw.gpus_per_node + 1)
             if hw.gpus_per_node % c == 0 and pb.world % c == 0]
    return min((dataclasses.replace(pb, grid=g, node_aware=True) for g in grids),
               key=lambda q: predict("attention2d-no", q, hw).total_s)


def _speedups(pb: Problem, hw: Hardware) -> tuple[float, str]:
    t = {a: predict(a, pb, hw).total_s for a in names()}
    return t["ring"], f"{t['ring'] / t['attention2d-no']:.1f} / {t['ring'] / t['attention2d-o']:.1f}"


def table_papers() -> list[Table]:
    """The papers' settings: Attention2D vs ring (attention2d.txt Sec. 4.1, 4.3), tree vs ring decode
    (tree-attention.txt Sec. 6.1), next to their claims."""
    a100 = HARDWARE["a100-pcie"]
    a100_nics = dataclasses.replace(a100, nics_per_node=None)
    rows = []
    for name, h, d in (("760M", 16, 96), ("2.7B", 32, 80), ("13B", 40, 128)):
        for P in (16, 64):
            for S in (65536, 262144, 524288):
                pb = Problem(S, P, h, head_dim=d, node_aware=False)
                ring, col = _speedups(pb, a100)
                aware = _node_aware_best(pb, a100)
                g, ga = pb.attention2d_grid(), aware.grid
                rows.append({"model (h, d)": f"{name} ({h}, {d})", "P": P, "S": _k(S), "ring ms": ring * 1e3,
                             "column-major grid (paper)": f"{col} ({g[0]}x{g[1]})",
                             "node-aware grid": f"{_speedups(aware, a100)[1]} ({ga[0]}x{ga[1]})",
                             "column-major, one NIC per GPU": _speedups(pb, a100_nics)[1]})
    out = [Table(
        "attention2d.txt Sec. 4.1: A100 nodes of 4 GPUs on PCIe, Ethernet between nodes (a100-pcie: FA2 "
        f"{a100.fwd_tflops / 1e12:.0f}/{a100.bwd_tflops / 1e12:.0f} TFLOP/s, PCIe {a100.intra_bw / 1e9:.0f} GB/s, "
        f"one {a100.inter_bw / 1e9:.0f} GB/s NIC per node). b = 1, causal, bf16, one layer fwd+bwd. Cells: "
        "speed-up of attention2d-no / attention2d-o over ring. Paper: more than 2x for every model and length on 16 "
        "and 64 GPUs, up to 5x on 64.", rows)]
    eth = dataclasses.replace(HARDWARE["h100-eth"], **FA2_H100)
    eth_p2p = dataclasses.replace(eth, p2p_ratio=HARDWARE["h200-sockets"].p2p_ratio)
    rows = []
    for name, h, d in (("66B", 72, 128), ("175B", 96, 128)):
        for S in (65536, 131072, 262144, 524288):
            pb = Problem(S, 64, h, head_dim=d)
            ring, sp = _speedups(pb, eth)
            rows.append({"model (h, d)": f"{name} ({h}, {d})", "S": _k(S), "ring ms": ring * 1e3, "speed-up": sp,
                         f"speed-up with p2p at {eth_p2p.p2p_ratio:g} of the collectives' bandwidth (as measured "
                         "over sockets)": _speedups(pb, eth_p2p)[1]})
    out.append(Table(
        "attention2d.txt Sec. 4.3: 64 nodes of one H100 on Ethernet (h100-eth with FA2 rates "
        f"{eth.fwd_tflops / 1e12:.0f}/{eth.bwd_tflops / 1e12:.0f} TFLOP/s, {eth.inter_bw / 1e9:.0f} GB/s per node), "
        "P = 64, 8 x 8 grid, b = 1, causal, bf16, one layer fwd+bwd. Cells: speed-up of attention2d-no / "
        "attention2d-o over ring. Paper: up to 9.4x (66B and 175B, one pipeline stage).", rows))
    hw = HARDWARE["h100-ib"]
    rows = []
    for P in (8, 64, 128):
        for S in (640000, 1280000, 5120000):
            t = {m: predict_decode(m, DecodeProblem(S, P, 16), hw) * 1e6 for m in DECODE_METHODS}
            rows.append({"GPUs": P, "context": f"{S / 1e6:g}M", **t,
                         "ring / best tree": t["ring-decode"] / min(t[m] for m in DECODE_METHODS[:3])})
    us = lambda v: f"{v:.0f}"  # noqa: E731
    out.append(Table(
        "tree-attention.txt Sec. 6.1: DGX H100 nodes (8 GPUs on NVLink, one NDR NIC per GPU: h100-ib), 16 heads, "
        "d = 128, b = 1, one new token, bf16, eager; us per layer. Paper: tree 'close to 8x' faster than ring at 128 "
        "GPUs and 5.12M tokens.", rows, dict.fromkeys((*DECODE_METHODS, "ring / best tree"), us)))
    return out


def table_node8(hw_names=("h200-nvlink", "h200-sockets")) -> list[Table]:
    """P = 4 and 8 on one 8 x H200 node: every algorithm, fwd and fwd+bwd, S 128k-512k, h 16 / 32, h_kv h and h/4."""
    out = []
    for hw_name in hw_names:
        hw, rows = HARDWARE[hw_name], []
        for P in (4, 8):
            for S in (131072, 262144, 524288):
                for h in (16, 32):
                    for hk in (h, h // 4):
                        pb = Problem(S, P, h, hk, node_aware=False)
                        t = {a: predict(a, pb, hw) for a in names()}
                        rows.append({"P": P, "S": _k(S), "h/h_kv": f"{h}/{hk}",
                                     **{a: f"{_ms(t[a].fwd_s * 1e3)} / {_ms(t[a].total_s * 1e3)}" for a in names()},
                                     "grid": _grid(t["attention2d-no"]), "auto": choose_algo(pb, hw)[0]})
        out.append(Table(f"{hw_name}: b = 1, d = 128, bf16, causal; ms per layer (fwd / fwd+bwd); default grid, "
                         "column-major (as bench.cp_attention runs it); 'auto' = choose_algo's pick for fwd+bwd", rows))
    return out


def table_decode(hw_names=("h200-nvlink", "h200-sockets")) -> list[Table]:
    """Decode on one 8 x H200 node, Llama-3.1-8B attention (32 heads, 8 KV heads, d = 128), b = 1, one token."""
    out = []
    for hw_name in hw_names:
        hw, rows = HARDWARE[hw_name], []
        for P in (2, 4, 8):
            for S in (32768, 131072, 524288, 1048576):
                dp = DecodeProblem(S, P, 32, 8)
                t = {m: predict_decode(m, dp, hw) * 1e6 for m in DECODE_METHODS}
                g = {m: predict_decode(m, dp, hw, graphed=True) * 1e6 for m in DECODE_METHODS}
                one = tuple(predict_decode("tree-allreduce2", dataclasses.replace(dp, world=1), hw, graphed=x) * 1e6
                            for x in (False, True))
                ratio = tuple(x["ring-decode"] / min(x[m] for m in DECODE_METHODS[:3]) for x in (t, g))
                rows.append({"P": P, "context": _k(S), **{m: (t[m], g[m]) for m in DECODE_METHODS},
                             "one GPU": one, "ring / best tree": ratio})
        pair = lambda v: f"{v[0]:.0f} / {v[1]:.0f}"  # noqa: E731
        out.append(Table(f"{hw_name}: Llama-3.1-8B attention (h = 32, h_kv = 8, d = 128), b = 1, 1 token, bf16; us "
                         "per layer, eager / CUDA-graphed", rows,
                         {**dict.fromkeys((*DECODE_METHODS, "one GPU"), pair),
                          "ring / best tree": lambda v: f"{v[0]:.1f} / {v[1]:.1f}"}))
    return out


def decode_step_rows(meas: dict) -> list[tuple[dict, dict]]:
    """(row, decode_step_time's prediction) for each row of one measured decode-step set: a row's own batch, pdl,
    mem_bw and small_per_layer override the set's; its method (the merge at CP > 1) defaults to tree-allgather, its
    mlp (the MLPs split over the CP ranks or whole) to whole."""
    from megatron_cp_plugin.cost.decode import DecodeModel, decode_step_time

    m, hw = DecodeModel(**meas["model"]), HARDWARE[meas["hardware"]]
    return [(r, decode_step_time(m, r["context"], r["world"], hw, batch=r.get("batch", 1),
                                 mem_bw=r.get("mem_bw", meas["mem_bw"]), pdl=r.get("pdl", meas["pdl"]),
                                 small_per_layer=r.get("small_per_layer", meas["small_per_layer"]),
                                 method=r.get("method", "tree-allgather"), mlp=r.get("mlp", "whole"),
                                 peer_rounds=r.get("peer_rounds", 2)))
            for r in meas["rows"]]


def table_decode_step() -> list[Table]:
    """Whole graphed decode steps of the 8B shape (cost/decode.decode_step_time): the measured rows against the
    model, then predictions at CP = 1-8 on H100 and H200."""
    from megatron_cp_plugin.cost.decode import DecodeModel, decode_step_time

    measured = load_measured()
    out = []
    for key, what in (("decode_step", "constants fitted on the first two rows"),
                      ("decode_step_h200", "a check: nothing fitted on it"),
                      ("decode_step_h200_peer", "per-device GEMV blocks, allgather against peer in one run; a "
                                                "check (PEER_SIGNAL_S was fitted on its 128k pair until the "
                                                "thirteenth session)"),
                      ("decode_step_h100_split", "the MLPs whole against split over the CP ranks in one run; a check "
                                                 "(PEER_SUM_S is the peer-sum benchmark's figure)"),
                      ("decode_step_h200_split", "the same on H200s, batch 8 included; a check"),
                      ("decode_step_h200_rounds", "split MLPs with the peer kernels in two flag rounds against one "
                                                  "(symmetric.fence); PEER_SIGNAL_S is this run's 128k batch-1 "
                                                  "pair, the rest a check"),
                      ("decode_step_h200_grouped", "q, k, v grouped out of the QKV kernel (no query copy: 3 small "
                                                   "kernels a layer); a check"),
                      ("decode_step_h100_grouped", "the same code on H100s; a check")):
        meas = measured[key]
        m = DecodeModel(**meas["model"])
        rows = []
        for r, p in decode_step_rows(meas):
            rows.append({"CP": r["world"], "context": _k(r["context"]), "batch": r.get("batch", 1),
                         "merge": r.get("method", "tree-allgather")[5:] if r["world"] > 1 else "-",
                         "MLPs": r.get("mlp", "whole") if r["world"] > 1 else "-",
                         "rounds": r.get("peer_rounds", 2) if r.get("method") == "tree-peer" else "-",
                         "PDL": "on" if r.get("pdl", meas["pdl"]) else "off",
                         "TB/s": r.get("mem_bw", meas["mem_bw"]) / 1e12, "measured ms": r["ms"],
                         "predicted ms": p["total"] * 1e3, "error": p["total"] * 1e3 / r["ms"] - 1,
                         "x floor measured": r["ms"] / (p["floor"] * 1e3)})
        out.append(Table(f"decode step, measured against the model ({meas['device']}; the 8B shape, graphed, tree; "
                         f"{what})", rows,
                         {"TB/s": lambda v: f"{v:.2f}", "measured ms": lambda v: f"{v:.2f}",
                          "predicted ms": lambda v: f"{v:.2f}", "error": lambda v: f"{v:+.1%}",
                          "x floor measured": lambda v: f"{v:.2f}"}))
    rows = []
    for name in ("h100-ib", "h200-nvlink"):
        for P in (1, 2, 4, 8):
            for S in (32768, 131072, 524288):
                one = decode_step_time(m, S, 1, HARDWARE[name])["total"]
                for mlp in ("whole", "split") if P > 1 else ("whole",):
                    p = decode_step_time(m, S, P, HARDWARE[name], method="tree-peer" if P > 1 else "tree-allgather",
                                         mlp=mlp, peer_rounds=1 if mlp == "split" and P > 1 else 2)
                    rows.append({"hardware": name, "CP": P, "context": _k(S), "MLPs": mlp if P > 1 else "-",
                                 "ms": p["total"] * 1e3, "floor ms": p["floor"] * 1e3,
                                 "x floor": p["total"] / p["floor"], "tokens/s over CP = 1": one / p["total"]})
    out.append(Table("decode step predicted (the 8B shape, batch 1, graphed, tree peer at P > 1 (one node), the MLPs "
                     "whole on every rank or split over the CP ranks (the static decoder's default at P > 1; the "
                     "floor then counts a rank's share; the peer kernels then in one flag round, symmetric.fence); "
                     "the fused linears with the residual adds inside, q, k, v grouped: 3 small kernels a layer; "
                     "PDL; hw.mem_bw as the floor's bandwidth)", rows,
                     {c: (lambda v: f"{v:.2f}") for c in ("ms", "floor ms", "x floor", "tokens/s over CP = 1")}))
    return out


def table_problem(pb: Problem, hw: Hardware) -> Table:
    """Every feasible algorithm's prediction for one problem, and choose_algo's pick."""
    rows = []
    for algo in names():
        if pb.feasible(algo):
            r = predict(algo, pb, hw)
            rows.append({"algo": algo, "grid": _grid(r), "fwd ms": r.fwd_s * 1e3, "fwd+bwd ms": r.total_s * 1e3,
                         "MiB sent fwd": r.fwd_bytes / 2**20, "MiB sent bwd": r.bwd_bytes / 2**20})
    return Table(f"{hw.name}: S = {pb.seq_len}, P = {pb.world}, h = {pb.heads}, h_kv = {pb.kv_heads}, "
                 f"d = {pb.head_dim}, b = {pb.batch}; choose_algo: {choose_algo(pb, hw)[0]}", rows,
                 {"fwd ms": lambda v: f"{v:.4g}", "fwd+bwd ms": lambda v: f"{v:.4g}",
                  "MiB sent fwd": lambda v: f"{v:.1f}", "MiB sent bwd": lambda v: f"{v:.1f}"})


def table_scale() -> list[Table]:
    """bench/cost_scale.py: P = 16-64 over 100-400 Gb/s against ring-te, on two topologies; the paper's claims."""
    pair = lambda v: f"{v[0]:.2f} / {v[1]:.2f}"  # noqa: E731
    fmt = {"N": _k, **dict.fromkeys(cost_scale.SCALE_ALGOS[1:], pair)}
    rows = {t: cost_scale.scale_rows(t) for t in ("8/node", "1/node")}
    out = [Table(f"{t}: {cost_scale.link_hardware(t, 400).name.split(' at')[0]} with its NICs at the given line rate "
                 f"({cost_scale.USABLE:.0%} of it usable), h = 32, d = 128, b = 1, bf16, causal, one layer fwd+bwd. "
                 "ring-te ms: its predicted time; algorithm cells: predicted time / mean bytes per rank, each over "
                 "ring-te's; grid: Attention2D's default (choose_grid), placed row-major where its columns divide "
                 "a node", rs, fmt) for t, rs in rows.items()]
    out.append(Table("The attention2d paper's Sec. 4 claims (its baseline: TransformerEngine's ring, our ring-te) "
                     "beside the model's speed-up of the faster Attention2D variant over ring-te, over the rows "
                     "above (all links, heads and lengths unless stated)", cost_scale.claims_rows(rows)))
    return out


def table_bytes() -> list[Table]:
    """bench/cost_scale.py: mean bytes per rank over ring-te's at P = 4, 16, 64 against issue 16's targets."""
    r2 = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    return [Table("Mean bytes per rank per fwd+bwd over ring-te's (comm_bytes averaged over ranks), MHA (h = 32, "
                  "d = 128), bf16, N = 128k, b = 1, causal; grids column-major as bench.cp_attention runs them; "
                  "target: the chosen Attention2D variant's, issue 16", cost_scale.bytes_rows(),
                  {c: r2 for c in ("ring", "burst", "attention2d-no", "attention2d-o", "attention2d-no row-major",
                                   "target (issue 16)", "before issue 16")})]


TABLES = {"measured": table_measured, "papers": table_papers, "node8": table_node8, "decode": table_decode,
          "decode-step": table_decode_step,
          "scale": table_scale, "bytes": table_bytes,
          "step": lambda: [Table(cost_step.title(), cost_step.step_rows(), {"factor": lambda v: f"{v:.3g}"})]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="megatron-cp-bench cost-model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", nargs="+", choices=sorted(TABLES) + ["all"], default=None)
    p.add_argument("--measured", default=None, metavar="PATH",
                   help=f"the measured figures (default: {MEASURED_PATH.relative_to(MEASURED_PATH.parents[2])} "
                        "in the repository)")
    p.add_argument("--out", default=None, metavar="STEM", help="also write STEM.json and STEM.md")
    p.add_argument("--hardware", choices=sorted(HARDWARE), default="h200-nvlink")
    p.add_argument("--seq", type=int, default=None, help="one problem: sequence length (with --cp)")
    p.add_argument("--cp", type=int, default=2, help="context-parallel size")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--grid", default=None, metavar="RxC")
    a = p.parse_args(argv)
    if a.table is None and a.seq is None:
        p.error("give --table or --seq")
    sections: dict[str, list[Table]] = {}
    try:
        for name in (sorted(TABLES) if a.table and "all" in a.table else a.table or []):
            sections[name] = table_measured(load_measured(a.measured)) if name == "measured" else TABLES[name]()
        if a.seq is not None:
            try:
                grid = tuple(int(x) for x in a.grid.lower().split("x")) if a.grid else None
            except ValueError:
                raise ValueError(f"--grid must be RxC (e.g. 2x2), got {a.grid!r}") from None
            pb = Problem(a.seq, a.cp, a.heads, a.kv_heads, a.head_dim, a.batch, grid=grid)
            sections["problem"] = [table_problem(pb, HARDWARE[a.hardware])]
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"megatron-cp-bench cost-model: {e}") from None
    text = "\n\n".join(f"## {name}\n\n" + "\n\n".join(t.markdown() for t in tables)
                       for name, tables in sections.items()) + "\n"
    print(text, end="")
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out + ".json", "w") as f:
            json.dump({"command": " ".join(sys.argv), "device": "none (analytical model)",
                       "tables": {n: [{"title": t.title, "rows": t.rows} for t in ts] for n, ts in sections.items()}},
                      f, indent=1)
        with open(a.out + ".md", "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
