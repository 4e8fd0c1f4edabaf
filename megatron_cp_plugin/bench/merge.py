"""The fp32 accumulation kernel (kernels/merge.py `accumulate_`) against torch's add_ / copy_, and the fused (o, lse)
merge `merge_` against its PyTorch form, on one GPU.

    megatron-cp-bench merge --rows 2048 8192 32768

Per row count (query rows of one block; 32 heads, d = 128): o [1, rows, h, d] fp32 with lse [1, h, rows] fp32,
merged with a bf16 block (o_blk) and its fp32 lse; an fp32 accumulator row slice acc[:, rows] of a tensor twice
as long, added into (and set from, copy=True) with a bf16 block gradient. Median ms of --iters calls (CUDA
events, after warm-up), the speedup of the kernel and the bandwidth each reaches on the bytes it moves, beside
the device copy bandwidth measured in the same run (inference/floor.copy_bandwidth). Bytes per element of o
(n = rows * h * d) and per row (rows * h), bf16 block:
    merge_reference_  18 n + 44 rows   (PyTorch: o_blk's fp32 copy written and read again; five [b, h, s] passes)
    merge_            10 n + 12 rows   (Triton: o read and written, o_blk read; lse read and written, lse_blk read)
    add_, accumulate_ 10 n             (acc read and written, x read: the same bytes, torch's kernel is not
                                        vectorised for mixed dtypes)
    copy_, accumulate_(copy=True) 6 n
Without a GPU it says so and exits 0.
"""
from __future__ import annotations

import argparse

import torch

from megatron_cp_plugin.bench._common import time_ms, write_report


def _cases(r: int, h: int, d: int, dev) -> list:
    """(op, implementation, fn, bytes moved) of one row count; the PyTorch form of each op first."""
    from megatron_cp_plugin.kernels import merge as M

    def kernel(*a, **k):                         # the kernel at every size (the runs take torch's below the bound)
        bound, M.ACCUMULATE_MIN_NUMEL = M.ACCUMULATE_MIN_NUMEL, 0
        try:
            M.accumulate_(*a, **k)
        finally:
            M.ACCUMULATE_MIN_NUMEL = bound

    n = r * h * d
    o = torch.randn(1, r, h, d, device=dev)
    lse = torch.randn(1, h, r, device=dev)
    o_blk = torch.randn(1, r, h, d, device=dev, dtype=torch.bfloat16)
    lse_blk = torch.randn(1, h, r, device=dev)
    acc = torch.zeros(1, 2 * r, h, d, device=dev)[:, r // 2:r // 2 + r]      # a row slice, as in the ring
    return [
        ("merge", "merge_reference_ (PyTorch)", lambda: M.merge_reference_(o, lse, o_blk, lse_blk), 18 * n + 44 * r * h),
        ("merge", "merge_ (Triton)", lambda: M.merge_(o, lse, o_blk, lse_blk), 10 * n + 12 * r * h),
        ("add", "acc.add_(x)", lambda: acc.add_(o_blk), 10 * n),
        ("add", "accumulate_ (Triton)", lambda: kernel(acc, o_blk), 10 * n),
        ("copy", "acc.copy_(x)", lambda: acc.copy_(o_blk), 6 * n),
        ("copy", "accumulate_(copy=True)", lambda: kernel(acc, o_blk, copy=True), 6 * n),
    ]


def main(argv=None):
    p = argparse.ArgumentParser(prog="megatron-cp-bench merge", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="results/merge")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("megatron-cp-bench merge: needs a CUDA GPU (it times GPU kernels); nothing run")
        return 0
    from megatron_cp_plugin.inference.floor import copy_bandwidth

    dev, h, d = torch.device("cuda"), a.heads, a.head_dim
    bw = copy_bandwidth(dev)
    rows = []
    for r in a.rows:
        cases, base = _cases(r, h, d, dev), {}
        for op, name, fn, nbytes in cases:
            ms = time_ms(fn, warmup=5, iters=a.iters)
            base.setdefault(op, ms)
            rows.append({"rows": r, "op": op, "implementation": name, "ms": ms, "speedup": base[op] / ms,
                         "bytes_moved": nbytes, "GB_per_s": nbytes / ms / 1e6,
                         "fraction_of_copy_bw": nbytes / (ms * 1e-3) / bw})
            print(f"{r:6d} {name:24s} {ms:8.4f} ms  x{base[op] / ms:5.2f}  {nbytes / ms / 1e6:7.0f} GB/s", flush=True)
        cases = fn = None                                  # this size's tensors freed before the next
    header = (f"merge and accumulation, one {torch.cuda.get_device_name(dev)}: o [1, rows, {h}, {d}] fp32, bf16 block, "
              f"fp32 accumulator slice; median of {a.iters}. speedup: over the PyTorch form of the same op; "
              f"GB/s on each implementation's own bytes (module docstring); measured copy bandwidth "
              f"{bw / 1e12:.2f} TB/s.")
    print(write_report(rows, a.out, header), flush=True)
    return 0


if __name__ == "__main__":
    main()
