"""Every algorithm side by side with single-GPU attention on the full sequence and the external anchors
(PyTorch's native context parallel, TransformerEngine's, ring-flash-attn: bench/anchors.py), in one run.

    megatron-cp-bench attention --seq 32768 131072 [--slow-link]      (under torchrun --nproc-per-node P)
    torchrun --nproc-per-node 2 -m megatron_cp_plugin.bench.cp_attention --seq 131072

Every rank times the same call with CUDA events (median of --iters after --warmup), the slowest rank
counting; the single-GPU baseline runs on rank 0 alone over the full sequence with the default local kernel
(cuDNN on Hopper). Reported: ms, TFLOP/s per GPU (FLOP formula printed), the ratio to the single-GPU time
(scaling efficiency = 1 / (P * ratio)), the ratio to the fastest PyTorch native CP configuration and to
`ring-te` (fwd_bwd_x_ring_te: our ring with TransformerEngine's p2p byte budget, dK, dV in the input dtype; the
baseline of issue 16's targets), peak memory, and bytes sent per fwd+bwd (our algorithms count them; anchors do
not expose theirs). TransformerEngine's own p2p ring (`te-p2p`) runs as an anchor where `import
transformer_engine` works; elsewhere the report says why and rank 0 prints one line.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import megatron_cp_plugin as mcp
from megatron_cp_plugin.algos import registry
from megatron_cp_plugin.bench.anchors import Unavailable, builders
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

    try:
        fwd_bwd()
    except ValueError as e:             # heads an all-to-all cannot split (ulysses): every rank raises it alike
        if not str(e).startswith("heads:"):
            raise
        raise Unavailable(str(e)) from None
    return fwd, fwd_bwd, stats


def _add_ratio(rows, column, is_ref):
    """Add `column`: each row's fwd+bwd time over the fastest row of its S for which is_ref(algo) holds (nan
    where none of that S ran). Rows that did not run get no entry."""
    for r in rows:
        best = [x["fwd_bwd_ms"] for x in rows if x["S"] == r["S"] and is_ref(x["algo"]) and "fwd_bwd_ms" in x]
        if "fwd_bwd_ms" in r:
            r[column] = r["fwd_bwd_ms"] / min(best) if best else float("nan")


def _ratios(rows):
    """fwd_bwd_x_torch_cp (over the fastest PyTorch native CP configuration) and, next to it,
    fwd_bwd_x_ring_te (over ring-te, the ring with TransformerEngine's byte budget)."""
    _add_ratio(rows, "fwd_bwd_x_torch_cp", lambda a: a.startswith("torch-cp-"))
    _add_ratio(rows, "fwd_bwd_x_ring_te", lambda a: a == "ring-te")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--algos", nargs="+", default=list(registry.names(baselines=True)),
                   help="our algorithms and baselines to run (default: all, ring-te included)")
    p.add_argument("--anchors", nargs="*", default=None, help="external anchors to run (default: all of "
                   "bench/anchors.py; none with an empty list)")
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
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
                fwd_bwd()
            base["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0
            rows[-1]["peak_GiB"] = base["peak_GiB"]
        dist.barrier()
        anchors = builders(causal)
        names = list(a.algos) + [n for n in anchors if a.anchors is None or n in a.anchors]
        for name in names:
            if dev.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            stats, closer = None, None
            try:
                if name in anchors:
                    fwd, fwd_bwd, closer = anchors[name](q, k, v, do)
                else:
                    fwd, fwd_bwd, stats = _cp(name, q, k, v, do, causal, group)
            except Unavailable as e:
                if rank == 0:
                    rows.append({"S": s, "algo": f"{name} (not run: {e})", "P": world})
                    if name == "te-p2p" and s == a.seq[0]:    # the anchor issue 16 asks for: say so once
                        print(f"cp_attention: te-p2p anchor not run: {e}", file=sys.stderr)
                continue
            t1 = gather_max(time_ms(fwd, warmup=a.warmup, iters=a.iters))
            t2 = gather_max(time_ms(fwd_bwd, warmup=a.warmup, iters=a.iters))
            peak = gather_max(torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0)
            if closer is not None:
                closer.close()
            if rank == 0:
                calls = a.warmup + a.iters + 1
                sent = (stats.forward_bytes + stats.backward_bytes) / calls / 2**20 if stats else float("nan")
                rows.append({"S": s, "algo": name, "P": world, "fwd_ms": t1, "fwd_bwd_ms": t2,
                             "fwd_TFLOPs/GPU": f1 / world / t1 / 1e9, "fwd_bwd_TFLOPs/GPU": f2 / world / t2 / 1e9,
                             "fwd_x_single": t1 / base["fwd"], "fwd_bwd_x_single": t2 / base["fwd_bwd"],
                             "MB_sent_fwd_bwd": sent, "peak_GiB": peak})
        del q, k, v, do
        torch.cuda.empty_cache() if dev.type == "cuda" else None
    if rank == 0:
        _ratios(rows)
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
        link = " over sockets (--slow-link)" if a.slow_link else ""
        header = (f"cp_attention: b={a.batch} h={a.heads} h_kv={hk} d={a.head_dim} causal={causal} {dtype} on "
                  f"{world} x {name}{link}. {FLOP_FORMULA}. Median of {a.iters} after {a.warmup} warm-up.")
        print(write_report(rows, a.out, header, plot=("S", "fwd_bwd_ms", "algo")))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
