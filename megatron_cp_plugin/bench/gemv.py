"""The decode step's fused linear (kernels/gemv.py) against what megatron-core runs (cuBLAS's matmul, then the bias
add and GELU as separate kernels), on one GPU, at the 8B decode shape's weights.

    megatron-cp-bench gemv --rows 1 8                  # each linear: ours vs torch's, us, TB/s of the weight
    megatron-cp-bench gemv --rows 1 8 --sweep          # every kernel configuration per shape (to tune config())
    megatron-cp-bench gemv --rows 1 8 --split 2        # also the MLPs split over CP = 2 (inference/split_mlp.py)

Per weight shape (QKV 6144 x 4096, the attention projection 4096 x 4096, fc1 14336 x 4096 with GELU, fc2 4096 x
14336) and row count: the mean us of a call replayed from one CUDA graph of --iters calls (what a graphed decode
step pays; the calls cycle over enough copies of the weight that none is read from L2, 50 MB on an H100),
the weight's bytes over that time (TB/s), the kernels per call, and the largest difference from the fp32
definition in units of the output's magnitude. --split P adds one rank's share of the MLPs split over P CP
ranks, as the static decoder runs them at P > 1: fc1's ffn / P rows (bias, GELU) and fc2's ffn / P columns, a
column slice of the whole [4096, 14336] weight (rows strided) written into an fp32 partial (`out=`, no bias: the
reduce adds it); torch's row for fc2/P is cuBLAS's matmul of the same slice (bf16 out). Without a GPU it says so and
exits 0.
"""
from __future__ import annotations

import argparse
import itertools
import math

import torch

from megatron_cp_plugin.bench._common import write_report

SHAPES = (("qkv", 6144, 4096, False), ("proj", 4096, 4096, False), ("fc1", 14336, 4096, True),
          ("fc2", 4096, 14336, False))
FFN, HIDDEN = 14336, 4096


def split_shapes(P: int) -> tuple:
    """(name, n, k, gelu, whole_k) of one rank's split MLP at CP = P: fc1's rows, fc2's columns of its whole_k."""
    f = FFN // P
    return ((f"fc1/{P}", f, HIDDEN, True, None), (f"fc2/{P}", HIDDEN, f, False, FFN))
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
    p.add_argument("--split", type=int, nargs="*", default=[], metavar="P",
                   help="also one rank's share of the MLPs split over P CP ranks (fc1 rows, fc2 strided columns)")
    p.add_argument("--out", default="results/gemv")
    a = p.parse_args(argv)
    if any(P < 2 or FFN % P for P in a.split):
        p.error(f"--split takes CP sizes >= 2 that divide the ffn {FFN}, got {a.split}")
    if not torch.cuda.is_available():
        print("megatron-cp-bench gemv: no GPU here; nothing measured")
        return 0
    from megatron_cp_plugin.bench.norm import _kernels
    from megatron_cp_plugin.kernels import gemv as G

    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    shapes = [(*x, None) for x in SHAPES] + [x for P in a.split for x in split_shapes(P)]
    for (name, n, k, gelu, whole_k), m in itertools.product(shapes, a.rows):
        copies = max(2, math.ceil(L2_BYTES / (n * k * 2)))
        # A column slice (fc2's share) is a view of a whole weight, rows strided as SplitFC2 reads them.
        ws = [(torch.randn(n, whole_k or k, device=dev, dtype=dt) / k ** 0.5)[:, :k] for _ in range(copies)]
        bs = [None if whole_k else torch.randn(n, device=dev, dtype=dt) for _ in range(copies)]
        x = torch.randn(1, m, k, device=dev, dtype=dt)
        part = torch.empty(1, m, n, device=dev, dtype=torch.float32) if whole_k else None   # the fp32 partial
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
            if whole_k:                             # cuBLAS over the same strided slice, bf16 out
                row("torch: matmul", lambda w, b: torch.matmul(x, w.t()))
            else:
                row("torch: matmul, + bias" + (", gelu" if gelu else ""), lambda w, b: _torch_linear(x, w, b, gelu))
            row("gemv (Triton), config()", lambda w, b: G.gemv(x, w, b, gelu=gelu, out=part),
                config=str(G.config(m, n, k, dev)))
            if a.sweep:
                grid = SWEEP_ROW1 if m == 1 else SWEEP_DOT
                for (bn, bk), warps, stages in itertools.product(grid, (4, 8), (2, 3, 4)):
                    cfg = (bn, bk, warps, stages)
                    try:
                        row("gemv sweep", lambda w, b, c=cfg: G.gemv(x, w, b, gelu=gelu, block=c, out=part),
                            config=str(cfg))
                    except Exception as e:          # a configuration Triton cannot compile (registers, shared memory)
                        print(f"{name} rows={m} {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        ws.clear(), bs.clear()
        part = None
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
