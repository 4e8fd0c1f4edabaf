"""The fused RMSNorm / LayerNorm kernel (kernels/norm.py) against torch's nn.RMSNorm and nn.LayerNorm, on one GPU.

    megatron-cp-bench norm --rows 1 8 4096 --hidden 4096

Per row count (1 and 8: a decode step's tokens; 4096: a prefill chunk), norm and weight dtype (fp32: what
megatron-core's local layer spec builds, nn.RMSNorm's default, on which torch takes its eight-kernel composite
for a bf16 input; bf16: torch's one fused kernel): median us of --iters calls of each, eager (CUDA events around a loop, so a call's launch counts) and replayed from a CUDA graph of --iters calls
(what a graphed decode step pays), and the kernels one call launches (torch.profiler). Without a GPU it says so
and exits 0.
"""
from __future__ import annotations

import argparse

import torch

from megatron_cp_plugin.bench._common import write_report


def _us(fn, iters: int, graphed: bool) -> float:
    """Mean us per call of `iters` back-to-back calls (median of 5 such loops), eager or one graph replay."""
    for _ in range(3):
        fn()
    loop = fn
    if graphed:
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(g):
            for _ in range(iters):
                fn()
        loop = g.replay
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        if graphed:
            loop()
        else:
            for _ in range(iters):
                loop()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / iters)
    return sorted(times)[2]


def _kernels(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main(argv=None):
    p = argparse.ArgumentParser(prog="megatron-cp-bench norm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 4096])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--out", default="results/norm")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("megatron-cp-bench norm: no GPU here; the kernel's comparison needs one (nothing run)")
        return 0
    from megatron_cp_plugin.inference.hooks import FusedNorm

    dev = torch.device("cuda")
    rows = []
    # torch's LayerNorm refuses an fp32 weight with a bf16 input (RMSNorm takes it, unfused: megatron-core's local
    # spec), so LayerNorm has bf16 weights only (an H100 run, 2026-11-26, raised on that row before)
    cases = [("RMSNorm", torch.float32), ("RMSNorm", torch.bfloat16), ("LayerNorm", torch.bfloat16)]
    for kind, wdt in cases:
        module = (torch.nn.RMSNorm(a.hidden, eps=1e-5) if kind == "RMSNorm" else torch.nn.LayerNorm(a.hidden))
        module = module.to(dev, wdt)
        ours = FusedNorm(module)
        for r in a.rows:
            x = torch.randn(1, r, a.hidden, device=dev, dtype=torch.bfloat16)
            with torch.no_grad():
                for impl, fn in ((f"torch nn.{kind}", lambda: module(x)), ("fused_norm (Triton)", lambda: ours(x))):
                    rows.append({"norm": kind, "weight": str(wdt)[6:], "rows": r, "hidden": a.hidden, "impl": impl,
                                 "eager_us": round(_us(fn, a.iters, False), 2),
                                 "graph_us": round(_us(fn, a.iters, True), 2), "kernels": _kernels(fn)})
                    print(rows[-1])
    header = (f"RMSNorm / LayerNorm of [1, rows, {a.hidden}] bf16 on {torch.cuda.get_device_name()}: us per call, "
              f"mean of {a.iters} back-to-back calls (median of 5 loops), eager and replayed from one CUDA graph; "
              "kernels per call (torch.profiler).")
    print(write_report(rows, a.out, header))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
