"""The fused bias + residual add and bias + GELU (kernels/bias_add.py) against torch's ops (megatron-core's
bias-dropout-add in eval; its MLP's fc1 bias and F.gelu), on one GPU.

    megatron-cp-bench bias-add --rows 1 8 4096 --hidden 4096

Per row count (1 and 8: a decode step's tokens; 4096: a prefill chunk): median us of --iters calls of each,
eager (CUDA events around a loop, so a call's launch counts) and replayed from a CUDA graph of --iters calls (what
a graphed decode step pays), and the kernels one call launches (torch.profiler); `same` says whether the two
outputs are equal bit for bit (bias + GELU: erf's last bits may differ between libraries; `max_ulps` says by how
much where |GELU| >= 2^-10, `tiny_abs` the largest absolute difference below, `differ` the fraction of elements
that differ). Without a GPU it says so and exits 0.
"""
from __future__ import annotations

import argparse

import torch

from megatron_cp_plugin.bench._common import write_report
from megatron_cp_plugin.bench.norm import _kernels, _us


def main(argv=None):
    p = argparse.ArgumentParser(prog="megatron-cp-bench bias-add", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 4096])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--out", default="results/bias_add")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("megatron-cp-bench bias-add: no GPU here; the kernel's comparison needs one (nothing run)")
        return 0
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    from megatron_cp_plugin.inference.hooks import FusedBiasDropoutAdd
    from megatron_cp_plugin.kernels.bias_add import fused_bias_gelu

    dev, rows = torch.device("cuda"), []
    own, ours = get_bias_dropout_add(False, False), FusedBiasDropoutAdd(get_bias_dropout_add)(False, False)
    for r in a.rows:
        x, res = (torch.randn(1, r, a.hidden, device=dev, dtype=torch.bfloat16) for _ in range(2))
        bias = torch.randn(a.hidden, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            same = torch.equal(own((x.clone(), bias), res.clone(), 0.0), ours((x, bias), res, 0.0))
            for impl, fn in (("torch: x + bias, + residual", lambda: own((x, bias), res, 0.0)),   # in place
                             ("fused_bias_residual (Triton)", lambda: ours((x, bias), res, 0.0))):
                rows.append({"op": "bias + residual", "rows": r, "hidden": a.hidden, "impl": impl,
                             "eager_us": round(_us(fn, a.iters, False), 2),
                             "graph_us": round(_us(fn, a.iters, True), 2), "kernels": _kernels(fn), "same": same,
                             "max_ulps": 0.0 if same else float("nan"), "tiny_abs": 0.0 if same else float("nan"),
                             "differ": 0.0 if same else float("nan")})
                print(rows[-1])
        f = 4 * a.hidden                                                  # fc1's output: the MLP's 4h
        y = torch.randn(1, r, f, device=dev, dtype=torch.bfloat16)
        fb = torch.randn(f, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            want, got = torch.nn.functional.gelu(y + fb), fused_bias_gelu(y, fb)
            # In bf16 ulps of the output where |GELU| >= 2^-10; below, where 1 + erf(x / sqrt 2) cancels (x < -3),
            # one fp32 ulp of erf is many of the output's, so there the absolute difference (H100, 2026-11-26:
            # 8.7 "ulps" of a -1e-6 output before this split)
            d, big = (got.float() - want.float()).abs(), want.float().abs() >= 2 ** -10
            ulps = float((d[big] / (want.float()[big].abs() * 2 ** -7)).max()) if big.any() else 0.0
            tiny_abs, differ = float(d[~big].max()) if (~big).any() else 0.0, float((got != want).float().mean())
            for impl, fn in (("torch: x + bias, F.gelu", lambda: torch.nn.functional.gelu(y + fb)),
                             ("fused_bias_gelu (Triton)", lambda: fused_bias_gelu(y, fb))):
                rows.append({"op": "bias + GELU", "rows": r, "hidden": f, "impl": impl,
                             "eager_us": round(_us(fn, a.iters, False), 2),
                             "graph_us": round(_us(fn, a.iters, True), 2), "kernels": _kernels(fn),
                             "same": torch.equal(got, want), "max_ulps": round(ulps, 2),
                             "tiny_abs": tiny_abs, "differ": round(differ, 6)})
                print(rows[-1])
    header = (f"bias + residual add of [1, rows, {a.hidden}] and bias + GELU of [1, rows, {4 * a.hidden}], bf16, on "
              f"{torch.cuda.get_device_name()}: us per call, "
              f"mean of {a.iters} back-to-back calls (median of 5 loops), eager and replayed from one CUDA graph; "
              "kernels per call (torch.profiler); same: the outputs equal bit for bit (torch's row adds in place, as "
              "megatron-core does where no operand needs gradients; its values drift over the loop, its time not); "
              "bias + GELU: max_ulps of the output where |GELU| >= 2^-10, tiny_abs the largest difference below "
              "(1 + erf cancels there), differ the fraction of elements not equal.")
    print(write_report(rows, a.out, header))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
