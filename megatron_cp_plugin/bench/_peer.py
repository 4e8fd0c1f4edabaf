"""What the two NVLink peer-kernel benchmarks share (bench/peer_merge.py, bench/peer_sum.py): the torchrun start
with its one-line refusal where the kernel cannot run, each variant timed eagerly and replayed from a CUDA graph, and
the end (report, graphs freed before the process group goes)."""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from megatron_cp_plugin.bench._common import gather_max, init_distributed, time_ms, write_report
from megatron_cp_plugin.bench.decode import graphed


def start(prog: str, doc: str, argv, add_args):
    """Parse argv (add_args(parser) adds the benchmark's own flags; --layers, --iters and --out are common), start
    the process group; (args, rank, world, device), or None where the peer kernel cannot run here (CPU, gloo, ranks
    sharing a GPU, one rank): rank 0 has said why in one line and the group is gone."""
    p = argparse.ArgumentParser(prog=f"megatron-cp-bench {prog}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    p.add_argument("--layers", type=int, default=32, help="calls a step (one a layer)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=f"results/{prog.replace('-', '_')}")
    a = p.parse_args(argv)
    rank, world, dev = init_distributed()
    from megatron_cp_plugin.symmetric import unsupported_reason

    why = "one rank: nothing to exchange" if world == 1 else unsupported_reason(None, dev, collective=True)
    if why is None:
        return a, rank, world, dev
    if rank == 0:
        print(f"megatron-cp-bench {prog}: the peer kernel cannot run here ({why}); nothing run")
    dist.destroy_process_group()
    return None


def time_calls(fns: dict, a, graphs: list) -> dict:
    """{name}_eager_us and {name}_graph_us for each step function (a.layers calls), per call, median of a.iters,
    slowest rank; the graph row NaN where no graph can be captured."""
    row = {}
    for name, fn in fns.items():
        row[f"{name}_eager_us"] = gather_max(time_ms(fn, iters=a.iters, before=dist.barrier)) * 1e3 / a.layers
        replay = graphed(fn, graphs)
        row[f"{name}_graph_us"] = float("nan") if replay is None else \
            gather_max(time_ms(replay, iters=a.iters, before=dist.barrier)) * 1e3 / a.layers
    return row


def finish(rows: list, a, header: str, graphs: list, rank: int, dev) -> int:
    """Rank 0 writes the report; the graphs go before the process group (they hold NCCL work)."""
    if rank == 0:
        write_report(rows, a.out, header)
    torch.cuda.synchronize(dev)
    graphs.clear()
    dist.barrier()
    dist.destroy_process_group()
    return 0
