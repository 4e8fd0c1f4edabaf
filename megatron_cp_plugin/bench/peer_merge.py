"""Tree decoding's exchange + merge: the peer kernel (kernels/peer_merge.py, one kernel over NVLink) against the
all-gather variant's NCCL all-gather + merge kernel, per call, under torchrun (one GPU a rank, one node):

    torchrun --nproc-per-node 2 -m megatron_cp_plugin.bench peer-merge --rows 32 256 --layers 32

Per row count (32: batch 1 of the 8B shape, 32 query heads; 256: batch 8), a "step" is --layers calls on the same
packed partial (o [rows, 128], lse) of each rank, as a graphed decode step makes them; each is timed eagerly and
replayed from one CUDA graph (the step's way), median of --iters, slowest rank, us per call. Both merge the same
partials: `max_diff` is the largest difference of their outputs (fp32). Where the peer kernel cannot run (CPU, gloo,
ranks sharing a GPU, one rank) it says why and exits 0.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_cp_plugin.bench import _peer
from megatron_cp_plugin.bench._common import gather_max


def main(argv=None):
    def flags(p):
        p.add_argument("--rows", type=int, nargs="+", default=[32, 256])
        p.add_argument("--head-dim", type=int, default=128)

    got = _peer.start("peer-merge", __doc__, argv, flags)
    if got is None:
        return 0
    a, rank, world, dev = got
    from megatron_cp_plugin.comm import all_gather
    from megatron_cp_plugin.kernels import flash_decode as fd
    from megatron_cp_plugin.kernels.peer_merge import peer_merge
    from megatron_cp_plugin.symmetric import peer_buffers

    d, rows_out, graphs = a.head_dim, [], []
    for R in a.rows:
        bufs = peer_buffers(None, R * (d + 1), dev)
        g = torch.Generator(device=dev).manual_seed(rank)
        packed = bufs.data[:R * (d + 1)]
        packed.copy_(torch.cat([torch.randn(R * d, device=dev, generator=g), torch.randn(R, device=dev, generator=g)]))
        out_p, lse_p = torch.empty(R, d, device=dev), torch.empty(R, device=dev)

        def peer():
            for _ in range(a.layers):
                peer_merge(bufs, R, d, out_p, lse_p)

        def gathered():
            for _ in range(a.layers):
                out = fd.merge_packed(all_gather(dist.group.WORLD, packed), d)
            return out

        peer()
        ref = gathered()
        torch.cuda.synchronize(dev)
        diff = gather_max((out_p - ref[0]).abs().max().item())
        row = {"rows": R, "world": world, "layers": a.layers, "max_diff": diff,
               **_peer.time_calls({"allgather": gathered, "peer": peer}, a, graphs)}
        rows_out.append(row)
        if rank == 0:
            print(f"rows {R}: allgather {row['allgather_graph_us']:.1f} us graphed ({row['allgather_eager_us']:.1f} "
                  f"eager), peer {row['peer_graph_us']:.1f} ({row['peer_eager_us']:.1f}) per call; max diff "
                  f"{diff:.1e}", flush=True)
    return _peer.finish(rows_out, a, f"Exchange + merge per call, {world} x {torch.cuda.get_device_name(dev)}, d {d}, "
                        f"{a.layers} calls a step, median of {a.iters}, slowest rank (bench/peer_merge.py)",
                        graphs, rank, dev)


if __name__ == "__main__":
    raise SystemExit(main())
