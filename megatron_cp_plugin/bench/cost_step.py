"""`megatron-cp-bench cost-model --table step`: the model's P = 4 NVLink training step per algorithm beside the
measured one (issue 26).

Measured 2026-11-22 on 4 H200 over NVLink: GPT-3 2.7B (configs/gpt3-2.7b.toml: 32 layers, 32 heads of 80,
hidden 2560) at 64k tokens, MFU attention2d-no 0.354, attention2d-o 0.362, ring 0.388 (Attention2D's step 1.06x
ring's). A step's time follows from its MFU: model FLOPs (training/report.py's formula, one sample) / (P x MFU x
peak), peak = the 784 TFLOP/s bf16 matmul peak measured on these H200s (docs/performance.md). Predicted step =
the rest of the step (everything but attention, the same for every algorithm: taken from ring's measured step
minus the model's 32 ring attention layers, so ring's row matches by construction) + 32 x the model's attention
layer (fwd + bwd) of the algorithm, with each algorithm's compute factor from cost/compute.py (the fit of
`megatron-cp-bench rank`) and, beside it, the analytic compute (factor 1.0).
"""
from __future__ import annotations

from ..cost import HARDWARE, Problem, predict
from ..cost import compute as cost_compute

MEASURED_MFU = {"ring": 0.388, "attention2d-no": 0.354, "attention2d-o": 0.362}   # 2026-11-22, issue 26
PEAK = 784e12
LAYERS, HEADS, HEAD_DIM, HIDDEN, VOCAB, SEQ, P = 32, 32, 80, 2560, 50304, 65536, 4


def model_flops() -> float:
    """One 64k sample's training FLOPs: 6 params tokens + 6 layers hidden seq tokens (training/report.py);
    params = 12 L hidden^2 + 13 L hidden + vocab hidden (Megatron's count, no position table: RoPE)."""
    params = 12 * LAYERS * HIDDEN ** 2 + 13 * LAYERS * HIDDEN + VOCAB * HIDDEN
    return 6.0 * params * SEQ + 6.0 * LAYERS * HIDDEN * SEQ * SEQ


def step_rows(hw_name: str = "h200-nvlink") -> list[dict]:
    hw, pb = HARDWARE[hw_name], Problem(SEQ, P, HEADS, HEADS, HEAD_DIM)
    flops = model_flops()
    measured = {a: flops / (P * m * PEAK) for a, m in MEASURED_MFU.items()}
    fit = {a: predict(a, pb, hw).total_s for a in MEASURED_MFU}
    with cost_compute.disabled():
        analytic = {a: predict(a, pb, hw).total_s for a in MEASURED_MFU}
    rows = []
    for model, attn in (("fit", fit), ("analytic", analytic)):
        rest = measured["ring"] - LAYERS * attn["ring"]
        for a in MEASURED_MFU:
            step = rest + LAYERS * attn[a]
            rows.append({"compute": model, "algo": a, "attention ms/layer": attn[a] * 1e3, "pred step s": step,
                         "meas step s": measured[a], "pred MFU": flops / (P * step * PEAK), "meas MFU": MEASURED_MFU[a],
                         "pred / ring": step / (rest + LAYERS * attn["ring"]), "meas / ring": measured[a] / measured["ring"],
                         "factor": cost_compute.factor(a, P, pb.attention2d_grid() if a != "ring" else None)})
    return rows


def title(hw_name: str = "h200-nvlink") -> str:
    src = cost_compute.load() and "configs/rank_compute.json" or "none measured yet: every factor 1.0"
    return (f"{hw_name}, P = 4: GPT-3 2.7B at 64k tokens (32 layers, h = 32, d = 80, b = 1, bf16), one training "
            f"step. meas: 2026-11-22 on 4 H200 (MFU -> step at a {PEAK / 1e12:.0f} TFLOP/s peak); pred: the non-"
            "attention rest from ring's measured step + 32 predicted attention layers. compute 'fit': each "
            f"algorithm's factor from `megatron-cp-bench rank` ({src}); 'analytic': factor 1.0")
