"""The surrogate O of the backward (kernels/surrogate.py): the fused Triton kernel against the PyTorch reference
on one GPU.

    megatron-cp-bench surrogate [--rows 262144 65536 2097152] [--head-dim 128] [--rows-per-program 8 16 32]
        [--select argmax keys] [--num-warps 2 4 8] [--programs-per-sm 0 4 16] [--index-bits 64 32]
        [--slice-cols 128 32]

One call per row count, as BurstAttention / Attention2D make per travelling query block: dO [1, rows / h, h, d]
bf16 and D [1, h, rows / h] fp32 from a real O (the default 262144 rows = 8192 tokens x 32 heads is one block of
`scripts/profile_rank.py --seq-len 131072 --cp 16`). Per row count: median ms of --iters calls (CUDA events,
after warm-up) of the reference and the kernel, the speedup, and the kernel's bandwidth on the bytes it must move,
against the device copy bandwidth measured in the same run:
    bytes = rows * d * (2 B read + 2 B written) + rows * 4 B (D);  copy bandwidth = 2 * bytes / time of a 1 GiB copy.
Both outputs' worst relative error of rowsum(dO * out) against D is printed with them. The kernel rows are every
combination of --select (ways of finding a row's top entries: kernels/surrogate.py SELECT, the A/B of its default),
--slice-cols, --num-warps, --rows-per-program, --programs-per-sm (0: a program a tile) and --index-bits (each default:
the module's). Without a GPU: one line, exit 0.
"""
from __future__ import annotations

import argparse
import itertools

import torch

from megatron_cp_plugin.bench._common import not_fitting, time_ms, write_report

BYTES_PER_ELEMENT = 48   # dO, O (bf16), the reference's fp32 temporaries (x, |x|, out, sign, ...) and the output


def _rel_err(do, out, delta) -> float:
    got = (do.double() * out.double()).sum(-1).transpose(1, 2)
    return ((got - delta.double()).abs() / delta.double().abs().clamp_min(1e-30)).max().item()


def main(argv=None):
    p = argparse.ArgumentParser(prog="megatron-cp-bench surrogate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[8192 * 32, 2048 * 32, 65536 * 32],
                   help="rows (tokens x heads) per call")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--rows-per-program", type=int, nargs="*", default=[],
                   help="rows per program to try (powers of two; default: the module's)")
    p.add_argument("--num-warps", type=int, nargs="*", default=[],
                   help="warps per program to try (powers of two; default: the module's NUM_WARPS)")
    p.add_argument("--programs-per-sm", type=int, nargs="*", default=[],
                   help="programs an SM to try (0: a program a tile of rows; default: the module's PROGRAMS_PER_SM)")
    p.add_argument("--index-bits", type=int, nargs="*", default=[], choices=(32, 64),
                   help="the kernel's row and offset arithmetic to try (default: the module's INDEX_BITS)")
    p.add_argument("--slice-cols", type=int, nargs="*", default=[],
                   help="columns of a row's slice (kernels/surrogate.py SLICE_COLS); default: the module's")
    p.add_argument("--select", nargs="+", choices=("argmax", "keys"), default=["argmax", "keys"],
                   help="how the kernel finds a row's top entries (kernels/surrogate.py SELECT): a row each")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="results/surrogate")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("megatron-cp-bench surrogate: needs a CUDA GPU (the Triton kernel against the reference); none here, "
              "nothing run", flush=True)
        return 0
    from megatron_cp_plugin.inference.floor import copy_bandwidth
    from megatron_cp_plugin.kernels.surrogate import surrogate_out_reference, surrogate_out_triton, use_kernel

    dev = torch.device("cuda")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    bw = copy_bandwidth(dev)
    rows_out = []
    for n in a.rows:
        why = not_fitting(n * a.head_dim * BYTES_PER_ELEMENT, dev)
        if why:
            rows_out.append({"rows": n, "kernel": "every kernel", "not_run": why})
            print(f"{n}: {why}", flush=True)
            continue
        s = n // a.heads
        do = torch.randn(1, s, a.heads, a.head_dim, device=dev, dtype=dtype)
        delta = (do.float() * torch.randn_like(do).float()).sum(-1).transpose(1, 2).contiguous()
        assert use_kernel(do), "the kernel cannot run on this device / dtype / head_dim"
        moved = do.numel() * (2 * do.element_size()) + delta.numel() * 4
        kernels = {"reference (PyTorch)": lambda do=do, delta=delta: surrogate_out_reference(do, delta)}
        for sel, w, nw, rpp, pps, ib in itertools.product(
                a.select, a.slice_cols or [None], a.num_warps or [None], a.rows_per_program or [None],
                a.programs_per_sm or [None], a.index_bits or [None]):
            name = (f"kernel (Triton), {sel}" + (f", {w}-column slices" if w else "") + (f", {nw} warps" if nw else "")
                    + (f", {rpp} rows/program" if rpp else "") + (f", {pps} programs/SM" if pps is not None else "")
                    + (f", int{ib}" if ib else ""))
            kernels[name] = (lambda sel=sel, w=w, nw=nw, rpp=rpp, pps=pps, ib=ib, do=do, delta=delta:
                             surrogate_out_triton(do, delta, select=sel, num_warps=nw, rows_per_program=rpp,
                                                  programs_per_sm=pps, index_bits=ib, slice_cols=w))
        ref_ms = None
        for name, fn in kernels.items():
            err = _rel_err(do, fn(), delta)
            ms = time_ms(fn, warmup=5, iters=a.iters)
            ref_ms = ref_ms or ms
            row = {"rows": n, "kernel": name, "ms": ms, "speedup": ref_ms / ms, "GB_per_s": moved / ms / 1e6,
                   "fraction_of_copy_bw": moved / (ms * 1e-3) / bw, "max_rel_err": err}
            rows_out.append(row)
            print(f"rows {n:>8d}  {name:60s} {ms:9.4f} ms  x{ref_ms / ms:6.1f}  {moved / ms / 1e6:7.0f} GB/s "
                  f"({moved / (ms * 1e-3) / bw:.0%} of copy)  rel err {err:.2g}", flush=True)
        del do, delta, kernels, fn
    header = (f"surrogate O, one {torch.cuda.get_device_name(dev)}: d={a.head_dim}, h={a.heads}, {a.dtype}, median "
              f"of {a.iters}. Bytes = rows * d * 2 * {torch.finfo(dtype).bits // 8} + rows * 4 (D); measured copy "
              f"bandwidth {bw / 1e12:.2f} TB/s.")
    print(write_report(rows_out, a.out, header), flush=True)
    return 0


if __name__ == "__main__":
    main()
