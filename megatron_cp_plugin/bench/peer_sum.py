"""The split MLPs' reduce: the peer kernel (kernels/peer_sum.py, one kernel over NVLink) against NCCL's all-reduce
of the fp32 partial followed by the bias and residual adds, per call, under torchrun (one GPU a rank, one node):

    torchrun --nproc-per-node 2 -m megatron_cp_plugin.bench peer-sum --rows 1 8 --hidden 4096 --layers 32

Per row count (1: batch 1, 8: batch 8), a "step" is --layers calls on each rank's fp32 partial [rows, hidden], as a
graphed decode step with split MLPs makes them; each is timed eagerly and replayed from one CUDA graph (the step's
way), median of --iters, slowest rank, us per call. Both reduce the same partials into bf16 with the same bias and
residual: `max_diff` is the largest difference of their outputs. Where the peer kernel cannot run (CPU, gloo, ranks
sharing a GPU, one rank) it says why and exits 0.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_cp_plugin.bench import _peer
from megatron_cp_plugin.bench._common import gather_max


def main(argv=None):
    def flags(p):
        p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
        p.add_argument("--hidden", type=int, default=4096)

    got = _peer.start("peer-sum", __doc__, argv, flags)
    if got is None:
        return 0
    a, rank, world, dev = got
    from megatron_cp_plugin.kernels.peer_sum import peer_sum
    from megatron_cp_plugin.symmetric import peer_buffers

    n, rows_out, graphs = a.hidden, [], []
    for R in a.rows:
        bufs = peer_buffers(None, R * n, dev)
        g = torch.Generator(device=dev).manual_seed(rank)
        part = bufs.data[:R * n].view(R, n)
        part.copy_(torch.randn(R, n, device=dev, generator=g))
        g0 = torch.Generator(device=dev).manual_seed(1234)               # the same bias and residual everywhere
        bias = torch.randn(n, device=dev, generator=g0).bfloat16()
        res = torch.randn(R, n, device=dev, generator=g0).bfloat16()
        out_p = torch.empty(R, n, device=dev, dtype=torch.bfloat16)
        buf = part.clone()

        def peer():
            for _ in range(a.layers):
                peer_sum(bufs, R, n, out_p, bias=bias, residual=res)

        def nccl():
            for _ in range(a.layers):
                buf.copy_(part)                      # the GEMV would write it; the all-reduce works in place
                dist.all_reduce(buf)
                out = (buf + bias.float() + res.float()).bfloat16()
            return out

        peer()
        out_n = nccl()
        torch.cuda.synchronize(dev)
        diff = gather_max((out_p.float() - out_n.float()).abs().max().item())
        row = {"rows": R, "hidden": n, "world": world, "layers": a.layers, "max_diff": diff,
               **_peer.time_calls({"allreduce": nccl, "peer": peer}, a, graphs)}
        rows_out.append(row)
        if rank == 0:
            print(f"rows {R}: allreduce + adds {row['allreduce_graph_us']:.1f} us graphed "
                  f"({row['allreduce_eager_us']:.1f} eager), peer {row['peer_graph_us']:.1f} "
                  f"({row['peer_eager_us']:.1f}) per call; max diff {diff:.1e}", flush=True)
    return _peer.finish(rows_out, a, f"Split-MLP reduce per call, {world} x {torch.cuda.get_device_name(dev)}, hidden "
                        f"{n}, {a.layers} calls a step, median of {a.iters}, slowest rank (bench/peer_sum.py; "
                        "allreduce includes a copy of the partial, which the step's GEMV makes unnecessary)",
                        graphs, rank, dev)


if __name__ == "__main__":
    raise SystemExit(main())
