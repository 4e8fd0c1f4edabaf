"""Demo (the main job until Megatron pretraining lands): shard one long random sequence over several
processes, run every implemented algorithm forward + backward, and print each one's error against the
single-device result and its time.

    python -m megatron_cp_plugin.demo                 # CPU: 4 gloo processes; GPUs: one NCCL process per GPU
    python -m megatron_cp_plugin.demo --nproc 3 --seq 3072 --heads 8 --kv-heads 2
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import megatron_cp_plugin as mcp
from megatron_cp_plugin.bench._common import time_ms
from megatron_cp_plugin.comm import init_group, serve_store
from megatron_cp_plugin.kernels.local_attn import block_bwd, block_fwd, select_backend


def _worker(rank: int, a: argparse.Namespace, port: int) -> None:
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // a.nproc))
    init_group("nccl" if cuda else "gloo", rank, a.nproc, port)
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(1, a.seq, n, a.head_dim, device=dev, dtype=dtype, generator=g)
                   for n in (a.heads, a.kv_heads, a.kv_heads, a.heads))
    mask = "causal" if a.causal else "none"
    # The single-device result: the same local kernel over the whole sequence.
    t0 = time.perf_counter()
    o1, lse1 = block_fwd(q, k, v, mask=mask)
    single = (o1,) + tuple(t.to(dtype) for t in block_bwd(do, q, k, v, o1, lse1, mask=mask))
    t_single = (time.perf_counter() - t0) * 1e3
    if rank == 0:
        print(f"{a.nproc} x {'GPU (NCCL)' if cuda else 'CPU process (gloo)'}, S={a.seq}, h={a.heads}, "
              f"h_kv={a.kv_heads}, d={a.head_dim}, causal={a.causal}, {dtype}, kernel "
              f"{select_backend(dev, dtype, a.head_dim)}; single device fwd+bwd {t_single:.1f} ms")
        print(f"{'algo':8s} {'max |err| o':>12s} {'dq':>10s} {'dk':>10s} {'dv':>10s} {'fwd+bwd ms':>11s} "
              f"{'MB sent':>8s}")
    for algo in mcp.ALGORITHMS:
        shard = lambda t: mcp.shard_sequence(t, algo=algo)  # noqa: E731
        ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
        stats = mcp.CommStats()

        def step():
            o = mcp.context_parallel_attention(ql, kl, vl, algo=algo, causal=a.causal, comm_stats=stats)
            return (o,) + torch.autograd.grad(o, (ql, kl, vl), shard(do))

        outs = step()
        errs = [(x.float() - shard(r).float()).abs().max() for x, r in zip(outs, single)]
        err = torch.stack(errs)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        ms = time_ms(step, warmup=1, iters=3)
        if rank == 0:
            mb = (stats.forward_bytes + stats.backward_bytes) / 5 / 2**20
            print(f"{algo:8s} " + " ".join(f"{e:10.2e}" for e in err.tolist()) + f"   {ms:9.1f} {mb:8.2f}")
    dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    p.add_argument("--nproc", type=int, default=gpus or 4, help="processes (default: GPUs, or 4 on CPU)")
    p.add_argument("--seq", type=int, default=None, help="full sequence length (default 4096 CPU, 65536 GPU)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    p.add_argument("--head-dim", type=int, default=64 if not gpus else 128)
    p.add_argument("--no-causal", dest="causal", action="store_false")
    a = p.parse_args(argv)
    a.seq = a.seq or (65536 if gpus else 4096)
    a.kv_heads = a.kv_heads or a.heads
    if gpus and a.nproc > gpus:
        p.error(f"--nproc {a.nproc} exceeds the {gpus} GPUs present")
    store = serve_store()                  # held while the ranks run: their rendezvous
    mp.spawn(_worker, args=(a, store.port), nprocs=a.nproc)


if __name__ == "__main__":
    main()
