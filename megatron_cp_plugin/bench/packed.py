"""Packed sequences (issue 18): every algorithm on lognormal documents against single-GPU varlen attention over
the same packing, and the same tokens as one unpacked causal sequence for contrast.

    torchrun --nproc-per-node 2 -m megatron_cp_plugin.bench packed --tokens 131072 --mean-doc 4096

Documents: lognormal lengths (mean --mean-doc, --sigma), each rounded to a multiple of 2P (the unit of every
layout at P ranks), the last one taking what is left of --tokens; the same packing on every rank. Rows:
  single-GPU varlen     rank 0 alone, the whole packed sequence, one varlen kernel call (the packed default:
                        flash-attn's varlen or FA2-in-torch's)
  single-GPU dense      rank 0 alone, the same tokens as one causal sequence (the default kernel, and FA2)
  <algo> packed         every algorithm with cu_seqlens
  <algo> unpacked       every algorithm on the same tokens as one causal sequence
Times are medians of --iters CUDA-event timings after --warmup, the slowest rank counting. Useful TFLOP/s
count only the work inside documents (sum over documents of the causal FLOPs) for packed rows, the causal
FLOPs of the whole sequence for unpacked ones; fwd_bwd_x_varlen is the fwd+bwd time over single-GPU varlen's.
Memory: every row's need (cp_attention.attention_need; packed rows with their reordered copies) is checked against
what each rank has free before anything of it is allocated; a row that does not fit is reported not run, with
the reason (printed once by rank 0), and the run goes on.
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys

import torch
import torch.distributed as dist

import megatron_cp_plugin as mcp
from megatron_cp_plugin.algos import registry
from megatron_cp_plugin.bench._common import (FLOP_FORMULA, GiB, attention_flop, gather_max, init_distributed,
                                              not_fitting, time_ms, write_report)
from megatron_cp_plugin.bench.cp_attention import attention_need, input_bytes
from megatron_cp_plugin.kernels.local_attn import block_bwd, block_fwd, select_backend


def document_lengths(tokens: int, mean: float, unit: int, seed: int, sigma: float = 1.0) -> list[int]:
    """Lognormal lengths with mean `mean`, rounded to multiples of `unit` (at least one unit), summing to
    `tokens` (a multiple of unit): the last document takes what is left."""
    if tokens % unit:
        raise ValueError(f"--tokens {tokens} must be a multiple of the document unit {unit}")
    g = torch.Generator().manual_seed(seed)
    mu = math.log(mean) - sigma ** 2 / 2
    lens, left = [], tokens
    while left > 0:
        n = float(torch.empty(1).log_normal_(mu, sigma, generator=g))
        n = min(max(unit, int(round(n / unit)) * unit), left)
        lens.append(n)
        left -= n
    return lens


def _single(q, k, v, do, mask, cu=None, backend=None):
    kw = dict(mask=mask, backend=backend, cu_seqlens_q=cu)
    fwd = lambda: block_fwd(q, k, v, **kw)  # noqa: E731
    return fwd, lambda: block_bwd(do, q, k, v, *fwd(), **kw)


def _cp(algo, q, k, v, do, cu):
    ql, kl, vl = (mcp.shard_sequence(t, algo=algo, cu_seqlens=cu).requires_grad_() for t in (q, k, v))
    dol = mcp.shard_sequence(do, algo=algo, cu_seqlens=cu)
    stats = mcp.CommStats()

    def fwd():
        with torch.no_grad():
            return mcp.context_parallel_attention(ql, kl, vl, algo=algo, cu_seqlens=cu)

    def fwd_bwd():
        o = mcp.context_parallel_attention(ql, kl, vl, algo=algo, cu_seqlens=cu, comm_stats=stats)
        torch.autograd.grad(o, (ql, kl, vl), dol)

    fwd_bwd()
    return fwd, fwd_bwd, stats


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=131072)
    p.add_argument("--mean-doc", type=int, default=4096)
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the document lengths")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--algos", nargs="+", default=list(registry.names()), choices=registry.names())
    p.add_argument("--no-unpacked", action="store_true", help="skip the unpacked contrast rows")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default="results/packed")
    return p


def main(argv=None):
    a = parser().parse_args(argv)
    rank, world, dev = init_distributed()
    bench(a, rank, world, dev)
    dist.barrier()          # rank 0 writes the report first; a peer that tears gloo down meanwhile aborted it once
    dist.destroy_process_group()


def bench(a, rank, world, dev):
    """The benchmark proper, on an initialised process group (`main` sets it up and tears it down)."""
    hk = a.kv_heads or a.heads
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    shape = dict(h=a.heads, hk=hk, d=a.head_dim, elem=dtype.itemsize)
    lens = document_lengths(a.tokens, a.mean_doc, 2 * world, a.seed, a.sigma)
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
    offs = tuple(cu.tolist())                                  # host ints: no device sync per call
    flop = {("packed", b): sum(attention_flop(1, n, a.heads, a.head_dim, True, b) for n in lens) for b in (0, 1)}
    flop.update({("unpacked", b): attention_flop(1, a.tokens, a.heads, a.head_dim, True, b) for b in (0, 1)})
    rows, base = [], None

    def row(name, kind, n_gpus, t1, t2, sent=0.0, peak=0.0):
        return {"algo": name, "P": n_gpus, "fwd_ms": t1, "fwd_bwd_ms": t2,
                "fwd_bwd_TFLOPs/GPU": flop[(kind, 1)] / n_gpus / t2 / 1e9,
                "fwd_bwd_x_varlen": t2 / base if base else float("nan"), "MB_sent_fwd_bwd": sent, "peak_GiB": peak}

    def skip(name, n_gpus, why):
        if rank == 0:
            rows.append({"algo": name, "P": n_gpus, "not_run": why})
            print(f"packed: {name}: {why}", file=sys.stderr)

    def peak_gib():
        return torch.cuda.max_memory_allocated() / GiB if dev.type == "cuda" else 0.0

    why = not_fitting(input_bytes(a.tokens, **shape), dev)          # the full q, k, v, dO every rank holds
    if why:
        skip("inputs (full q, k, v, dO)", world, why)
        return _report(a, rank, world, dev, dtype, hk, lens, flop, rows)
    g = torch.Generator(device=dev).manual_seed(a.seed)
    q, k, v, do = (torch.randn(1, a.tokens, n, a.head_dim, device=dev, dtype=dtype, generator=g)
                   for n in (a.heads, hk, hk, a.heads))
    singles = [("varlen", "packed", offs, None)]
    dense_default = select_backend(dev, dtype, a.head_dim)
    singles.append((f"dense {dense_default}", "unpacked", None, None))
    if dev.type == "cuda" and dense_default != "flash":
        singles.append(("dense flash", "unpacked", None, "flash"))
    for name, kind, c, be in singles:       # rank 0 runs them; every rank takes part in the check (all-gather)
        backend = select_backend(dev, dtype, a.head_dim, be, packed=c is not None)
        why = not_fitting(attention_need("single", a.tokens, 1, **shape) if rank == 0 else 0, dev)
        if why:
            skip(f"single-GPU {name} ({backend})", 1, why)
            continue
        if rank != 0:
            continue
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        fwd, fwd_bwd = _single(q, k, v, do, "causal", c, be)
        t1 = time_ms(fwd, warmup=a.warmup, iters=a.iters)
        t2 = time_ms(fwd_bwd, warmup=a.warmup, iters=a.iters)
        if name == "varlen":
            base = t2
        rows.append(row(f"single-GPU {name} ({backend})", kind, 1, t1, t2, peak=peak_gib()))
    for algo, kind in itertools.product(a.algos, ("packed",) if a.no_unpacked else ("packed", "unpacked")):
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        why = not_fitting(attention_need(algo, a.tokens, world, packed=kind == "packed", **shape), dev)
        if why:
            skip(f"{algo} {kind}", world, why)
            continue
        fwd, fwd_bwd, stats = _cp(algo, q, k, v, do, offs if kind == "packed" else None)
        t1 = gather_max(time_ms(fwd, warmup=a.warmup, iters=a.iters, before=dist.barrier))
        t2 = gather_max(time_ms(fwd_bwd, warmup=a.warmup, iters=a.iters, before=dist.barrier))
        peak = gather_max(peak_gib())
        del fwd, fwd_bwd                      # the shards and buffers go before the next row checks what is free
        calls = a.warmup + a.iters + 1
        sent = (stats.forward_bytes + stats.backward_bytes) / calls / 2**20
        if rank == 0:
            rows.append(row(f"{algo} {kind}", kind, world, t1, t2, sent, peak))
    return _report(a, rank, world, dev, dtype, hk, lens, flop, rows)


def _report(a, rank, world, dev, dtype, hk, lens, flop, rows):
    if rank == 0:
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
        header = (f"packed: {a.tokens} tokens in {len(lens)} lognormal documents (mean {a.mean_doc}, sigma "
                  f"{a.sigma}, multiples of {2 * world}, longest {max(lens)}), h={a.heads} h_kv={hk} "
                  f"d={a.head_dim} causal {dtype} on {world} x {name}. Useful FLOPs: inside documents for packed "
                  f"rows ({flop[('packed', 1)] / 1e12:.1f} TFLOP fwd+bwd), the whole causal sequence for dense "
                  f"and unpacked ones ({flop[('unpacked', 1)] / 1e12:.1f}); {FLOP_FORMULA}. Median of {a.iters} "
                  f"after {a.warmup} warm-up.")
        print(write_report(rows, a.out, header))
    return rows


if __name__ == "__main__":
    main()
