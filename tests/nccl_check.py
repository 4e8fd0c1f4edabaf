"""GPU correctness check of every algorithm on NCCL in bf16 at long sequence (run under torchrun).

    torchrun --nproc-per-node 2 tests/nccl_check.py --seq 65536

Each rank builds the full problem, computes an fp64 reference with the chunked math kernel on its GPU, runs
the context-parallel algorithm on its shard, and requires the bf16 error (Frobenius-norm relative) of the
output and of dq, dk, dv to be at most twice that of single-GPU bf16 attention (the default fused kernel) on
the full sequence. Exits non-zero on any failure. tests/test_gpu.py runs it when GPUs are present.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

import megatron_cp_plugin as mcp
from megatron_cp_plugin.bench._common import init_distributed
from megatron_cp_plugin.kernels.local_attn import block_bwd, block_fwd


def _rel_l2(x, ref):
    return (torch.linalg.vector_norm(x.double() - ref) / torch.linalg.vector_norm(ref)).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=65536)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--algos", nargs="+", default=list(mcp.ALGORITHMS))
    a = p.parse_args()
    rank, world, dev = init_distributed()
    failures = 0
    for causal in (True, False):
        for h, hk in ((8, 8), (8, 2)):
            mask = "causal" if causal else "none"
            g = torch.Generator(device=dev).manual_seed(h * 10 + hk + causal)
            q, k, v, do = (torch.randn(1, a.seq, n, a.head_dim, device=dev, generator=g).bfloat16()
                           for n in (h, hk, hk, h))
            o64, lse64 = block_fwd(*(t.double() for t in (q, k, v)), mask=mask, backend="math", chunk_size=4096)
            ref = (o64,) + block_bwd(*(t.double() for t in (do, q, k, v)), o64, lse64, mask=mask, backend="math",
                                     chunk_size=4096)
            o1, lse1 = block_fwd(q, k, v, mask=mask)
            single = tuple(t.to(q.dtype) for t in (o1,) + block_bwd(do, q, k, v, o1, lse1, mask=mask))
            for algo in a.algos:
                shard = lambda t: mcp.shard_sequence(t, algo=algo)  # noqa: E731
                ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
                o = mcp.context_parallel_attention(ql, kl, vl, algo=algo, causal=causal)
                o.backward(shard(do))
                for name, x, r, s1 in zip(("o", "dq", "dk", "dv"), (o, ql.grad, kl.grad, vl.grad), ref, single):
                    err, tol = _rel_l2(x, shard(r)), 2 * _rel_l2(shard(s1), shard(r))
                    ok = err <= tol
                    failures += not ok
                    print(f"rank {rank} {algo:5s} P={world} S={a.seq} causal={causal!s:5s} h={h}/{hk} {name}: "
                          f"rel err {err:.3e} (single GPU {tol / 2:.3e}) {'ok' if ok else 'FAIL'}", flush=True)
            del ref, o64, lse64
    total = torch.tensor([failures], device=dev)
    dist.all_reduce(total)
    dist.destroy_process_group()
    sys.exit(1 if total.item() else 0)


if __name__ == "__main__":
    main()
