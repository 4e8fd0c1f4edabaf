"""The decode cost model's graphed mode and the tree merge variant it picks for the static decode step."""
from __future__ import annotations

import dataclasses

from pathlib import Path

import pytest

import megatron_cp_plugin.cost as cm
from megatron_cp_plugin.algos.tree_decode import COLLECTIVE_VARIANTS as VARIANTS
from megatron_cp_plugin.bench.cost_report import load_measured
from megatron_cp_plugin.cost import HARDWARE, DecodeProblem

# The measured figures: docs/results/cost_model_measured.json (data of the repository, next to these tests).
MEASURED = Path(__file__).resolve().parents[1] / "docs" / "results" / "cost_model_measured.json"


def _graphed_tree(names, context=None):
    """(set, row) of every CUDA-graphed tree-variant figure of the named decode sets."""
    sets = [s for s in load_measured(MEASURED)["decode"] if s["name"] in names]
    return [(s, r) for s in sets for r in s["rows"]
            if r["graphed"] and r["method"].startswith("tree") and context in (None, r["context"])]


def test_graphed_steps_are_predicted_faster_and_near_the_measurements():
    """Fit on one set, check on another. Fitted: GRAPH_LATENCY_RATIO, to differences between graphed rows at
    P = 2 (allreduce3 - allreduce2 of decode-p2, allgather - local shard of issue 17's run); GRAPH_LAUNCH_S is
    an estimate. Checked: the graphed totals at P = 2 and 128k (the same runs, but totals, not the differences
    fitted), and every graphed tree total at P = 4 (decode-p4: 128k and 512k), which no constant saw.
    Tolerance 25%: the per-kernel and per-collective costs are single figures for every size; at P = 2 the
    graphed totals are 3-28% over the measured between 32k and 512k. Ring decoding is left out of the P = 4
    check: its graphed time there is 2.4x / 1.4x the prediction at 128k / 512k (its P - 1 shard transfers moved
    134-242 GB/s, not the 360 GB/s p2p rate measured on one pair), unexplained (docs/cost_model.md)."""
    hw = HARDWARE["h200-nvlink"]
    for S in (32768, 131072, 524288):
        pb = DecodeProblem(S, 2, 32, 8)
        for m in cm.DECODE_METHODS:
            assert cm.predict_decode(m, pb, hw, graphed=True) < cm.predict_decode(m, pb, hw)
    p2 = _graphed_tree(("decode-p2", "decode-p2-issue17"), context=131072)
    p4 = _graphed_tree(("decode-p4",))
    assert {r["method"] for _, r in p2} == set(cm.DECODE_METHODS[:3]) and len(p4) == 6
    for s, r in p2 + p4:
        pb = DecodeProblem(r["context"], s["world"], s["heads"], s["kv_heads"], s["head_dim"], s["batch"])
        pred = cm.predict_decode(r["method"], pb, hw, graphed=True) * 1e6
        assert abs(pred / r["layer_us"] - 1) < 0.25, (s["name"], r, pred)


def test_choose_tree_variant_is_the_fastest_tree_method_for_each_mode():
    for hw_name, P in (("h200-nvlink", 2), ("h200-nvlink", 8), ("h100-ib", 64), ("h200-sockets", 4)):
        for graphed in (False, True):
            pb = DecodeProblem(262144, P, 32, 8, batch=2)
            best, times = cm.choose_tree_variant(pb, HARDWARE[hw_name], graphed=graphed)
            assert best in VARIANTS and set(times) == set(VARIANTS)
            direct = {v: cm.predict_decode(f"tree-{v}", pb, HARDWARE[hw_name], graphed=graphed) for v in VARIANTS}
            assert times == direct and best == min(direct, key=direct.get)
    # On 2 x H200 the one-collective allgather wins both ways (one all-gather + one merge kernel per layer).
    for graphed in (False, True):
        assert cm.choose_tree_variant(DecodeProblem(131072, 2, 32, 8), HARDWARE["h200-nvlink"], graphed=graphed)[0] \
            == "allgather"


def test_the_peer_variant_is_a_candidate_only_where_asked_and_within_a_node():
    hw = HARDWARE["h200-nvlink"]
    pb = DecodeProblem(131072, 2, 32, 8)
    best, times = cm.choose_tree_variant(pb, hw, graphed=True, peer=True)
    assert set(times) == set(VARIANTS) | {"peer"} and best == "peer"         # no collective: two flag rounds
    assert times["peer"] == cm.predict_decode(cm.PEER_METHOD, pb, hw, graphed=True)
    assert times["allgather"] - times["peer"] > cm.PEER_SIGNAL_S
    assert "peer" not in cm.choose_tree_variant(dataclasses.replace(pb, world=16), hw, graphed=True, peer=True)[1]
    assert cm.decode_bytes(cm.PEER_METHOD, pb) == cm.decode_bytes("tree-allgather", pb)
    m = cm.DecodeModel(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=257)
    ag, peer = (cm.decode_step_time(m, 131072, 2, hw, method=x) for x in ("tree-allgather", cm.PEER_METHOD))
    assert peer["exchange"] < ag["exchange"] and peer["gaps"] < ag["gaps"] and peer["floor"] == ag["floor"]
    with pytest.raises(ValueError, match="method"):
        cm.decode_step_time(m, 131072, 2, hw, method="ring-decode")
    # The MLPs split over the ranks: each reads 7.5 GB / P less of the 8B shape's weights, at one reduce a layer.
    split = cm.decode_step_time(m, 131072, 2, hw, method=cm.PEER_METHOD, mlp="split")
    assert m.mlp_bytes() == 32 * (2 * 14336 * 4096 + 14336) * 2
    assert split["floor"] == pytest.approx(peer["floor"] - m.mlp_bytes() / 2 / hw.mem_bw)
    assert split["exchange"] > peer["exchange"] and split["total"] < peer["total"] - 0.5e-3
    assert cm.decode_step_time(m, 131072, 1, hw, mlp="split") == cm.decode_step_time(m, 131072, 1, hw)
    with pytest.raises(ValueError, match="mlp must be"):
        cm.decode_step_time(m, 131072, 2, hw, mlp="half")
    # One flag round a peer call where the merge and the sum alternate: 64 rounds of PEER_SIGNAL_S fewer a step.
    one = cm.decode_step_time(m, 131072, 2, hw, method=cm.PEER_METHOD, mlp="split", peer_rounds=1)
    assert split["total"] - one["total"] == pytest.approx(64 * cm.PEER_SIGNAL_S) and one["floor"] == split["floor"]
    for bad in ({"peer_rounds": 3}, {"peer_rounds": 1, "mlp": "whole", "method": cm.PEER_METHOD},
                {"peer_rounds": 1, "mlp": "split"}):
        with pytest.raises(ValueError, match="peer_rounds must be"):
            cm.decode_step_time(m, 131072, 2, hw, **bad)


def test_decode_step_model_against_the_measured_steps():
    """cost/decode.decode_step_time against the graphed 8B-shape steps measured on H100s (constants fitted on the
    first two CP = 1 rows: within 2 %; the CP = 2 rows and the later H100 rows, with and without PDL, a check:
    within 6 %) and on H200s (every row a check, batch 8 and PDL included: within 6 %; with the per-device GEMVs
    and the peer merge beside allgather: within 7 %, and peer faster than allgather where both ran; on H100s the MLPs
    split against whole, and the same on H200s: within 6 %, split faster where both ran); its weights
    are the bench's 10.21 GB; PDL is faster by its gap."""
    from megatron_cp_plugin.bench.cost_report import decode_step_rows, load_measured
    from megatron_cp_plugin.cost.decode import DecodeModel, decode_step_time

    measured = load_measured(MEASURED)
    for key in ("decode_step", "decode_step_h200", "decode_step_h200_peer", "decode_step_h100_split",
                "decode_step_h200_split", "decode_step_h200_rounds", "decode_step_h200_grouped",
                "decode_step_h100_grouped"):
        meas = measured[key]
        m = DecodeModel(**meas["model"])
        assert abs(m.weight_bytes() - 10.21e9) < 0.005e9
        for i, (r, p) in enumerate(decode_step_rows(meas)):
            fitted = key == "decode_step" and i < 2
            # 512k on H200s: 7 %. Those rows are 4-7 % over: 34 GB of KV a step read faster than the run's own
            # bandwidth figure (4.18-4.21 TB/s) allows (and the peer set's graphed all-gather modelled above its
            # profile).
            h200_512k = meas["hardware"] == "h200-nvlink" and r["context"] >= 524288
            bar = 0.02 if fitted else 0.07 if h200_512k else 0.06
            assert abs(p["total"] * 1e3 / r["ms"] - 1) <= bar, (key, r, p)
            assert p["floor"] < p["total"] and (p["exchange"] > 0) == (r["world"] > 1)
        pairs = {}
        for r, p in decode_step_rows(meas):
            pairs.setdefault((r["context"], r.get("batch", 1), r["world"]), {})[r.get("method")] = (r["ms"], p["total"])
        for both in (x for x in pairs.values() if {"tree-allgather", "tree-peer"} <= set(x)):
            assert both["tree-peer"][0] < both["tree-allgather"][0] and both["tree-peer"][1] < both["tree-allgather"][1]
        halves = {}
        for r, p in decode_step_rows(meas):
            halves.setdefault((r["context"], r.get("batch", 1)), {})[r.get("mlp")] = (r["ms"], p["total"])
        for both in (x for x in halves.values() if {"whole", "split"} <= set(x)):   # split faster, measured and model
            assert both["split"][0] < both["whole"][0] and both["split"][1] < both["whole"][1]
        rounds = {}
        for r, p in decode_step_rows(meas):
            if r.get("mlp") == "split":
                key = (r["context"], r.get("batch", 1))
                rounds.setdefault(key, {})[r.get("peer_rounds", 2)] = (r["ms"], p["total"])
        for both in (x for x in rounds.values() if {1, 2} <= set(x)):  # one flag round faster, measured and model
            assert both[1][0] < both[2][0] and both[1][1] < both[2][1]
    on, off = (decode_step_time(m, 32768, 1, HARDWARE["h200-nvlink"], pdl=x)["total"] for x in (True, False))
    assert 0.1e-3 < off - on < 0.3e-3                           # 0.21 ms measured on one H100 and one H200
    with pytest.raises(ValueError, match="mem_bw must be positive"):
        decode_step_time(m, 1024, 1, HARDWARE["h100-ib"], mem_bw=0.0)
