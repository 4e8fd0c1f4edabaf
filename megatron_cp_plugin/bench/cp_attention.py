"""Ring and BurstAttention side by side with single-GPU attention on the full sequence, in one run.

    torchrun --nproc-per-node 2 -m megatron_cp_plugin.bench.cp_attention --seq 32768 131072 [--slow-link]

Every rank times the same call with CUDA events (median of --iters after --warmup); the single-GPU baseline
runs on rank 0 alone over the full sequence with the default local kernel (cuDNN on Hopper).
Reported: ms, TFLOP/s per GPU (FLOP formula printed), and the ratio to the single-GPU time.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import megatron_cp_plugin as mcp
from megatron_cp_plugin.bench._common import (FLOP_FORMULA, attention_flop, gather_max, init_distributed, time_ms,
                                              write_report)
from megatron_cp_plugin.kernels.local_attn import block_bwd, block_fwd, select_backend


def _single(q, k, v, do, causal):
    mask = "causal" if causal else "none"
    fwd = lambda: block_fwd(q, k, v, mask=mask)  # noqa: E731
    return fwd, lambda: block_bwd(do, q, k, v, *fwd(), mask=mask)


def _cp(algo, q, k, v, do, causal, group):
    ql, kl, vl = (mcp.shard_sequence(t, algo=algo, group=group).requires_grad_() for t in (q, k, v))
    dol = mcp.shard_sequence(do, algo=algo, group=group)
    stats = mcp.CommStats()

    def fwd():
        with torch.no_grad():
            return mcp.context_parallel_attention(ql, kl, vl, algo=algo, group=group, causal=causal)

    def fwd_bwd():
        o = mcp.context_parallel_attention(ql, kl, vl, algo=algo, group=group, causal=causal, comm_stats=stats)
        torch.autograd.grad(o, (ql, kl, vl), dol)

    fwd_bwd()
    return fwd, fwd_bwd, stats


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--algos", nargs="+", default=list(mcp.ALGORITHMS))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default="results/cp_attention")
    p.add_argument("--slow-link", action="store_true",
                   help="NCCL over sockets (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1): PCIe/Ethernet-class links")
    a = p.parse_args(argv)
    if a.slow_link:
        os.environ.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1")
    rank, world, dev = init_distributed()
    group, causal, hk = dist.group.WORLD, not a.no_causal, a.kv_heads or a.heads
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rows = []
    for s in a.seq:
        g = torch.Generator(device=dev).manual_seed(s)
        q, k, v, do = (torch.randn(a.batch, s, n, a.head_dim, device=dev, dtype=dtype, generator=g)
                       for n in (a.heads, hk, hk, a.heads))
        f1 = attention_flop(a.batch, s, a.heads, a.head_dim, causal, False)
        f2 = attention_flop(a.batch, s, a.heads, a.head_dim, causal, True)
        base = {}
        if rank == 0:
            fwd, fwd_bwd = _single(q, k, v, do, causal)
            base = {"fwd": time_ms(fwd, warmup=a.warmup, iters=a.iters),
                    "fwd_bwd": time_ms(fwd_bwd, warmup=a.warmup, iters=a.iters)}
            rows.append({"S": s, "algo": f"single-GPU {select_backend(dev, dtype, a.head_dim)}", "P": 1,
                         "fwd_ms": base["fwd"], "fwd_bwd_ms": base["fwd_bwd"],
                         "fwd_TFLOPs/GPU": f1 / base["fwd"] / 1e9, "fwd_bwd_TFLOPs/GPU": f2 / base["fwd_bwd"] / 1e9,
                         "fwd_x_single": 1.0, "fwd_bwd_x_single": 1.0, "MB_sent_fwd_bwd": 0.0})
        dist.barrier()
        for algo in a.algos:
            fwd, fwd_bwd, stats = _cp(algo, q, k, v, do, causal, group)
            t1 = time_ms(fwd, warmup=a.warmup, iters=a.iters)
            t2 = time_ms(fwd_bwd, warmup=a.warmup, iters=a.iters)
            t1, t2 = gather_max(t1), gather_max(t2)
            if rank == 0:
                calls = a.warmup + a.iters + 1
                rows.append({"S": s, "algo": algo, "P": world, "fwd_ms": t1, "fwd_bwd_ms": t2,
                             "fwd_TFLOPs/GPU": f1 / world / t1 / 1e9, "fwd_bwd_TFLOPs/GPU": f2 / world / t2 / 1e9,
                             "fwd_x_single": t1 / base["fwd"], "fwd_bwd_x_single": t2 / base["fwd_bwd"],
                             "MB_sent_fwd_bwd": (stats.forward_bytes + stats.backward_bytes) / calls / 2**20})
        del q, k, v, do
        torch.cuda.empty_cache() if dev.type == "cuda" else None
    if rank == 0:
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
        link = " over sockets (--slow-link)" if a.slow_link else ""
        header = (f"cp_attention: b={a.batch} h={a.heads} h_kv={hk} d={a.head_dim} causal={causal} {dtype} on "
                  f"{world} x {name}{link}. {FLOP_FORMULA}. Median of {a.iters} after {a.warmup} warm-up.")
        print(write_report(rows, a.out, header))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
