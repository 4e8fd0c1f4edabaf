"""The split-KV flash-decoding kernel (kernels/flash_decode.py) against the prefill kernels on one GPU.

    python -m megatron_cp_plugin.bench.flash_decode --context 16384 65536 262144

One decode token (n_q = 1, or --n-q for speculative verification), b = 1, Llama-3.1-8B heads (32 / 8 KV,
d = 128), bf16. A context whose K, V (with decode_model's margin) is more than the GPU has free is a row with
its one-line reason ("not_run"), decided before allocating. Per kernel: median ms of --iters calls (CUDA events,
after warm-up) and the bandwidth it reaches on the bytes it must read, divided by the device copy bandwidth
measured in the same run:
    KV bytes = 2 (K and V) * context * h_kv * d * 2 B;  copy bandwidth = 2 * bytes / time of a 1 GiB copy.
"""
from __future__ import annotations

import argparse

import torch

from megatron_cp_plugin.bench._common import not_fitting, time_ms, write_report
from megatron_cp_plugin.inference.floor import copy_bandwidth
from megatron_cp_plugin.kernels.flash_decode import flash_decode
from megatron_cp_plugin.kernels.local_attn import unsupported, block_fwd


def context_bytes(context: int, kv_heads: int, head_dim: int) -> int:
    """What one context allocates (K and V, bf16; q and the kernels' partials are below 0.1 %), with decode_model's
    margin."""
    from megatron_cp_plugin.bench.decode_model import MARGIN_BYTES, MARGIN_FRACTION

    return int(2 * context * kv_heads * head_dim * 2 * (1 + MARGIN_FRACTION) + MARGIN_BYTES)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, nargs="+", default=[16384, 65536, 262144])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--n-q", type=int, default=1)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="results/flash_decode")
    a = p.parse_args(argv)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    bw = copy_bandwidth(dev)
    rows = []
    for n in a.context:
        why = not_fitting(context_bytes(n, a.kv_heads, a.head_dim), dev)
        if why:
            rows.append({"context": n, "kernel": "every kernel", "not_run": why})
            print(f"{n}: {why}", flush=True)
            continue
        q = torch.randn(1, a.n_q, a.heads, a.head_dim, device=dev, dtype=dtype)
        k, v = (torch.randn(1, n, a.kv_heads, a.head_dim, device=dev, dtype=dtype) for _ in range(2))
        kv_bytes = 2 * k.numel() * k.element_size()
        kernels = {"flash_decode (split-KV, Triton)": lambda q=q, k=k, v=v: flash_decode(q, k, v)}
        for be in ("cudnn", "flash"):
            if not unsupported(be, dev, dtype, a.head_dim):
                kernels[f"{be} (prefill kernel)"] = lambda be=be, q=q, k=k, v=v: block_fwd(q, k, v, backend=be)
        base = None
        for name, fn in kernels.items():
            ms = time_ms(fn, warmup=5, iters=a.iters)
            base = base or ms
            rows.append({"context": n, "kernel": name, "ms": ms, "GB_per_s": kv_bytes / ms / 1e6,
                         "fraction_of_copy_bw": kv_bytes / (ms * 1e-3) / bw, "time_over_split_kv": ms / base})
        del q, k, v, kernels, fn                              # freed before the next context's check
    header = (f"flash-decoding, one {torch.cuda.get_device_name(dev)}: b=1, n_q={a.n_q}, h={a.heads}, "
              f"h_kv={a.kv_heads}, d={a.head_dim}, bf16, median of {a.iters}. Bytes = 2 * context * h_kv * d * 2; "
              f"measured copy bandwidth {bw / 1e12:.2f} TB/s.")
    print(write_report(rows, a.out, header, plot=("context", "ms", "kernel")), flush=True)


if __name__ == "__main__":
    main()
