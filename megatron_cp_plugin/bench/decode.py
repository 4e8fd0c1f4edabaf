"""Decode-step attention latency: tree decoding (each variant) vs ring decoding vs one GPU, side by side.

    torchrun --nproc-per-node 2 -m megatron_cp_plugin.bench.decode --context 32768 131072 524288

Llama-3.1-8B attention shape by default (32 heads, 8 KV heads, d = 128), b = 1, one new token, bf16; the
cache is split evenly over the ranks. Per layer: median of --iters CUDA-event timings after warm-up, the
slowest rank counting; a decode step of the whole model is --layers times that (attention only). The
one-GPU baseline runs the full cache on rank 0 where it fits. Byte formula printed in the header.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import megatron_cp_plugin as mcp
from megatron_cp_plugin.algos.ring_decode import ring_decode
from megatron_cp_plugin.algos.tree_decode import VARIANTS
from megatron_cp_plugin.bench._common import gather_max, init_distributed, time_ms, write_report
from megatron_cp_plugin.kernels.local_attn import block_fwd


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, nargs="+", default=[32768, 131072, 524288])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--single-max", type=int, default=1 << 20, help="largest context the one-GPU baseline runs")
    p.add_argument("--out", default="results/decode")
    a = p.parse_args(argv)
    rank, world, dev = init_distributed()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rows = []
    for n in a.context:
        s = n // world
        g = torch.Generator(device=dev).manual_seed(n + rank)
        q = torch.randn(1, 1, a.heads, a.head_dim, device=dev, dtype=dtype, generator=torch.Generator(device=dev).manual_seed(n))
        k, v = (torch.randn(1, s, a.kv_heads, a.head_dim, device=dev, dtype=dtype, generator=g) for _ in range(2))
        fns = {f"tree {var}": (lambda var=var: mcp.tree_decode(q, k, v, variant=var, validate=False))
               for var in VARIANTS}
        fns["ring-decode"] = lambda: ring_decode(q, k, v)
        fns["local shard only (no merge)"] = lambda: block_fwd(q, k, v)
        small = torch.zeros(a.heads * (a.head_dim + 1), device=dev)
        fns["one all_reduce of (o, lse) bytes"] = lambda: dist.all_reduce(small)
        res = {}
        for name, fn in fns.items():
            t = time_ms(fn, warmup=5, iters=a.iters)
            res[name] = gather_max(t)
        if rank == 0 and n <= a.single_max:
            kf, vf = (torch.randn(1, n, a.kv_heads, a.head_dim, device=dev, dtype=dtype) for _ in range(2))
            res["one GPU"] = time_ms(lambda: block_fwd(q, kf, vf), warmup=5, iters=a.iters)
            del kf, vf
        if rank == 0:
            ring = res["ring-decode"]
            for name, t in res.items():
                rows.append({"context": n, "method": name, "P": 1 if name == "one GPU" else world,
                             "layer_us": t * 1e3, "step_ms_x_layers": t * a.layers,
                             "ring_decode_over_this": ring / t})
        del k, v
    if rank == 0:
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
        kv_bytes = 2 * a.kv_heads * a.head_dim * torch.tensor([], dtype=dtype).element_size()
        header = (f"decode: b=1, 1 new token, h={a.heads}, h_kv={a.kv_heads}, d={a.head_dim}, {dtype}, {world} x {name}; "
                  f"median of {a.iters}; step = {a.layers} layers x layer time. Bytes per rank per layer: tree moves "
                  f"(o, lse) = b*h*(d+1)*4 = {a.heads * (a.head_dim + 1) * 4} B; ring-decode moves (P-1) shards of "
                  f"context/P * {kv_bytes} B.")
        print(write_report(rows, a.out, header))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
