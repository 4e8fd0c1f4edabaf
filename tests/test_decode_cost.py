"""The decode cost model's graphed mode and the tree merge variant it picks for the static decode step."""
from __future__ import annotations

import megatron_cp_plugin.cost_model as cm
from megatron_cp_plugin.algos.tree_decode import VARIANTS
from megatron_cp_plugin.cost_model import HARDWARE, DecodeProblem

# 2 x H200, 32 layers, Llama-3.1-8B attention, b = 1, one token, CUDA-graphed, us per layer: allreduce3 and
# allreduce2 from docs/results/decode.md, allgather from the run quoted in issue 17. GRAPH_LATENCY_RATIO was fitted to the differences between rows (allreduce3 -
# allreduce2, allgather - local shard); the totals below are checked, not fitted.
MEASURED_GRAPHED_128K = {"tree-allreduce3": 4.49e3 / 32, "tree-allreduce2": 3.66e3 / 32, "tree-allgather": 2.81e3 / 32}


def test_graphed_steps_are_predicted_faster_and_near_the_measurements():
    hw = HARDWARE["h200-nvlink"]
    for S in (32768, 131072, 524288):
        pb = DecodeProblem(S, 2, 32, 8)
        for m in cm.DECODE_METHODS:
            assert cm.predict_decode(m, pb, hw, graphed=True) < cm.predict_decode(m, pb, hw)
    pb = DecodeProblem(131072, 2, 32, 8)
    for m, us in MEASURED_GRAPHED_128K.items():
        pred = cm.predict_decode(m, pb, hw, graphed=True) * 1e6
        assert abs(pred / us - 1) < 0.25, (m, pred, us)


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
