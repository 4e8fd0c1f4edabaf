"""The decode step's fused linear (kernels/gemv.py) against what megatron-core runs (cuBLAS's matmul, then the bias
add and GELU as separate kernels), on one GPU, at the 8B decode shape's weights.

    megatron-cp-bench gemv --rows 1 8                  # each linear: ours vs torch's, us, TB/s of the weight
    megatron-cp-bench gemv --rows 1 8 --sweep          # every kernel configuration per shape (to tune config())

Per weight shape (QKV 6144 x 4096, the attention projection 4096 x 4096, fc1 14336 x 4096 with GELU, fc2 4096 x
14336) and row count: the mean us of a call replayed from one CUDA graph of --iters calls (what a graphed decode
step pays; the calls cycle over enough copies of the weight that none is read from L2, 50 MB on an H100),
the weight's bytes over that time (TB/s), the kernels per call, and the largest difference from the fp32
definition in units of the output's magnitude. Without a GPU it says so and exits 0.
"""
from __future__ import annotations

import argparse
import itertools
import math

import torch

from megatron_cp_plugin.bench._common import write_report

SHAPES = (("qkv", 6144, 4096, False), ("proj", 4096, 4096, False), ("fc1", 14336, 4096, True),
          ("fc2", 4096, 14336, False))
L2_BYTES = 256 << 20
"""Bytes of distinct weights each timed loop cycles over: several times any GPU's L2 (H100 50 MB, H200 60 MB)."""
SWEEP_ROW1 = [(bn, bk) for bn, bk in ((4, 1024), (8, 512), (8, 1024), (16, 256), (16, 512), (32, 256))]
SWEEP_DOT = [(bn, bk) for bn in (16, 32, 64) for bk in (128, 256, 512)]


def _graph_us(fns, iters: int) -> float:
    """Mean us per call of `iters` calls cycling over fns, replayed from one CUDA graph (median of 5 replays)."""
    for f in fns:
        f()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(iters):
            fns[i % len(fns)]()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / iters)
    return sorted(times)[2]


def _torch_linear(x, w, b, gelu):
    """What megatron-core's linear + MLP do on the plain path: matmul, then + bias, then F.gelu."""
    y = torch.matmul(x, w.t()) + b
    return torch.nn.functional.gelu(y) if gelu else y


def main(argv=None):
    p = argparse.ArgumentParser(prog="megatron-cp-bench gemv", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="input rows (decode tokens)")
    p.add_argument("--iters", type=int, default=40, help="calls per graph replay")
    p.add_argument("--sweep", action="store_true", help="time every kernel configuration, not only config()'s")
    p.add_argument("--out", default="results/gemv")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("megatron-cp-bench gemv: no GPU here; nothing measured")
        return 0
    from megatron_cp_plugin.bench.norm import _kernels
    from megatron_cp_plugin.kernels import gemv as G

    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for (name, n, k, gelu), m in itertools.product(SHAPES, a.rows):
        copies = max(2, math.ceil(L2_BYTES / (n * k * 2)))
        ws = [torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5 for _ in range(copies)]
        bs = [torch.randn(n, device=dev, dtype=dt) for _ in range(copies)]
        x = torch.randn(1, m, k, device=dev, dtype=dt)
        want = G.gemv_reference(x, ws[0], bs[0], gelu=gelu).float()
        scale = want.abs().max().item()

        def row(impl, fn, **extra):
            us = _graph_us([lambda i=i: fn(ws[i], bs[i]) for i in range(copies)], a.iters)
            err = (fn(ws[0], bs[0]).float() - want).abs().max().item() / scale
            r = {"linear": name, "n": n, "k": k, "rows": m, "impl": impl, "us": round(us, 2),
                 "TBps": round(n * k * 2 / us / 1e6, 3), "kernels": _kernels(lambda: fn(ws[0], bs[0])),
                 "max_err": float(f"{err:.2e}"), **extra}
            rows.append(r)
            print(r)
            return r

        with torch.no_grad():
            row("torch: matmul, + bias" + (", gelu" if gelu else ""), lambda w, b: _torch_linear(x, w, b, gelu))
            row("gemv (Triton), config()", lambda w, b: G.gemv(x, w, b, gelu=gelu), config=str(G.config(m, n, k, dev)))
            if a.sweep:
                grid = SWEEP_ROW1 if m == 1 else SWEEP_DOT
                for (bn, bk), warps, stages in itertools.product(grid, (4, 8), (2, 3, 4)):
                    cfg = (bn, bk, warps, stages)
                    try:
                        row("gemv sweep", lambda w, b, c=cfg: G.gemv(x, w, b, gelu=gelu, block=c), config=str(cfg))
                    except Exception as e:          # a configuration Triton cannot compile (registers, shared memory)
                        print(f"{name} rows={m} {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        ws.clear(), bs.clear()
        torch.cuda.empty_cache()
    best = {}
    for r in rows:
        key = (r["linear"], r["rows"])
        if r["impl"].startswith("gemv") and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    for (name, m), r in best.items():
        print(f"best {name} rows={m}: {r['config']} {r['us']} us {r['TBps']} TB/s")
    header = (f"Decode linears, bf16, on {torch.cuda.get_device_name()}: us per call replayed from one CUDA graph of "
              f"{a.iters} calls cycling over >= {L2_BYTES >> 20} MB of weights; TBps = weight bytes / us; kernels per "
              "call; max_err = largest |y - fp32 definition| over the largest |y|; config = (BLOCK_N, BLOCK_K, "
              "num_warps, num_stages).")
    print(write_report(rows, a.out, header))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
