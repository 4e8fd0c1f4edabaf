"""GPU check of packed sequences (issue 18) on NCCL, under torchrun: every algorithm, Attention2D on every grid.

    torchrun --nproc-per-node 2 tests/packed_nccl_check.py --tokens 32768 [--megatron]

Each rank builds the same packed problem: lognormal documents (mean --mean-doc tokens) plus a few of the
minimum size (2P) and a long one, bf16 q, k, v, dO ~ N(0, 1), MHA and GQA, causal and not. Per output and
gradient, on each rank's shard (Frobenius-norm relative error):
  1. against fp64 (the math kernel's varlen path on the GPU): at most twice the error of single-GPU varlen
     attention in bf16 over the same packing (flash-attn's criterion);
  2. against that single-GPU varlen backward run from our own (gathered) O: within --same-o-tol x eps(bf16).
--megatron (needs megatron-core): a tiny bf16 GPT on a packed batch with EOD-separated documents; the loss at
CP = P equals every document run alone on one GPU within 1e-2 (bf16).
Rank 0 prints one line per case; exits non-zero on any failure.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.distributed as dist

import megatron_cp_plugin as mcp
from megatron_cp_plugin.bench._common import init_distributed
from megatron_cp_plugin.bench.packed import document_lengths
from megatron_cp_plugin.kernels.local_attn import block_bwd, block_fwd

from nccl_check import grids, judge  # noqa: E402 (tests/ is this script's directory)


def _attention_check(a, rank, world, dev, built):
    unit = 2 * world
    lens = [unit, 8 * a.mean_doc] + document_lengths(a.tokens - 8 * a.mean_doc - 2 * unit, a.mean_doc, unit, 7)
    lens += [unit]
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
    runs = []
    for algo in a.algos:
        a2d = algo.startswith("attention2d")
        runs += [(algo, g, grid) for g, grid in built.items()] if a2d else [(algo, None, None)]
    failures = 0
    for causal, (h, hk) in itertools.product((True, False), ((8, 8), (8, 2))):
        mask = "causal" if causal else "none"
        gen = torch.Generator(device=dev).manual_seed(h * 10 + hk + causal)
        q, k, v, do = (torch.randn(1, int(cu[-1]), n, a.head_dim, device=dev, generator=gen).to(torch.bfloat16)
                       for n in (h, hk, hk, h))
        o64, lse64 = block_fwd(*(t.double() for t in (q, k, v)), mask=mask, backend="math", chunk_size=4096,
                               cu_seqlens_q=cu)
        ref = (o64,) + block_bwd(*(t.double() for t in (do, q, k, v)), o64, lse64, mask=mask, backend="math",
                                 chunk_size=4096, cu_seqlens_q=cu)
        del o64, lse64
        o1, lse1 = block_fwd(q, k, v, mask=mask, cu_seqlens_q=cu)
        single = tuple(t.to(torch.bfloat16) for t in (o1,) + block_bwd(do, q, k, v, o1, lse1, mask=mask,
                                                                          cu_seqlens_q=cu))
        same_bar = a.same_o_tol * torch.finfo(torch.bfloat16).eps
        for algo, g, grid in runs:
            shard = lambda t: mcp.shard_sequence(t, algo=algo, cu_seqlens=cu)  # noqa: E731
            ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
            try:        # raised before any collective, the same on every rank: heads an all-to-all cannot split
                o = mcp.context_parallel_attention(ql, kl, vl, algo=algo, causal=causal, group=grid, cu_seqlens=cu)
            except ValueError as e:
                if dist.get_rank() == 0:
                    print(f"packed {algo} P={world}: not run ({e})", flush=True)
                continue
            o.backward(shard(do))
            own_o = mcp.unshard_sequence(o.detach(), algo=algo, cu_seqlens=cu)
            same_o = (None,) + block_bwd(do, q, k, v, own_o, lse1, mask=mask, cu_seqlens_q=cu)
            where = "" if g is None else f" grid {g[0]}x{g[1]}{' row-major' if g[2] else ''}"
            failures += not judge((o, ql.grad, kl.grad, vl.grad), ref, single, same_o, shard, same_bar,
                                  f"packed {algo}{where} P={world} T={int(cu[-1])} docs={len(lens)} "
                                  f"causal={causal!s:5s} h={h}/{hk}")
            del ql, kl, vl, o, same_o
        del ref, single, o1, lse1
    return failures


def _megatron_check(rank, world, dev):
    """Tiny bf16 GPT per algorithm: the loss of a packed batch (EOD-separated documents, padded, positions
    reset) at CP = world equals the loss of every document run alone through the unpacked path of the same
    model, within 1e-2 (two bf16 runs with different kernels)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.module import Float16Module

    from megatron_cp_plugin.megatron import CPConfig, pack_documents, packed_unit, shard_batch
    from megatron_cp_plugin.megatron.model import build_gpt, tiny_config

    seq, vocab = 4096, 1024
    ps.initialize_model_parallel(context_parallel_size=world)
    cp_group = ps.get_context_parallel_group()
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab - 1, (1, seq), generator=g)
    tokens[0, [300, 301, 1500, 1517, 3000]] = vocab - 1
    batch = dict(tokens=tokens, labels=torch.roll(tokens, -1, 1), loss_mask=torch.ones(1, seq))

    def summed(per_token, mask):                   # (sum of masked losses, loss tokens) over the CP group
        x = torch.stack([(per_token.float() * mask).sum(), mask.sum()])
        dist.all_reduce(x, group=cp_group)
        return x

    failures = 0
    for algo in mcp.ALGORITHMS:
        cp = CPConfig(algo=algo, cp_size=world, seq_length=seq)
        torch.manual_seed(0)
        config = tiny_config(cp_size=world, hidden=256, heads=8, groups=2, ffn=512)
        config.bf16 = True
        model = Float16Module(config, build_gpt(config, cp, vocab_size=vocab, seq_length=seq,
                                                cp_group=cp_group).to(dev))
        packed = {k: (v.to(dev) if torch.is_tensor(v) else v)
                  for k, v in pack_documents(batch, eod=vocab - 1, unit=packed_unit(algo, world)).items()}
        with torch.no_grad():
            b = shard_batch(packed, algo=algo, cp_group=cp_group)
            got = summed(model(b["tokens"], b["position_ids"], None, labels=b["labels"],
                               packed_seq_params=b["packed_seq_params"]), b["loss_mask"])
            want = torch.zeros(2, device=dev)
            offs = packed["cu_seqlens"].tolist()
            for lo, hi in zip(offs, offs[1:]):     # every document alone, unpacked, positions from 0
                doc = {k: packed[k][:, lo:hi] for k in ("tokens", "labels", "loss_mask")}
                doc["position_ids"] = torch.arange(hi - lo, device=dev)[None]
                d = shard_batch(doc, algo=algo, cp_group=cp_group)
                want += summed(model(d["tokens"], d["position_ids"], None, labels=d["labels"]), d["loss_mask"])
        loss, ref = (got[0] / got[1]).item(), (want[0] / want[1]).item()
        ok = abs(loss - ref) <= 1e-2 * abs(ref)
        failures += not ok
        if rank == 0:
            print(f"megatron packed {algo} CP={world}: loss {loss:.5f}, documents alone {ref:.5f}  "
                  f"{'ok' if ok else 'FAIL'}", flush=True)
        del model
    ps.destroy_model_parallel()
    return failures


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--mean-doc", type=int, default=1024)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--algos", nargs="+", default=list(mcp.ALGORITHMS), choices=mcp.ALGORITHMS)
    p.add_argument("--same-o-tol", type=float, default=4.0, help="check 2's bar in units of eps(bf16)")
    p.add_argument("--megatron", action="store_true", help="also the tiny-GPT packed loss check (megatron-core)")
    a = p.parse_args()
    rank, world, dev = init_distributed()
    built = {g: mcp.CPGrid(dist.group.WORLD, *g) for g in grids(world)}
    failures = _attention_check(a, rank, world, dev, built)
    if a.megatron:
        failures += _megatron_check(rank, world, dev)
    total = torch.tensor([failures], device=dev)
    dist.all_reduce(total)
    if rank == 0:
        verdict = "all ok" if total.item() == 0 else f"{total.item()} rank-level failures"
        print(f"packed_nccl_check P={world}: {verdict}", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if total.item() else 0)


if __name__ == "__main__":
    main()
