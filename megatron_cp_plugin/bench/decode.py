"""Decode-step latency: tree decoding (each variant) vs ring decoding vs one GPU, side by side, next to the
memory-bandwidth floor.

    torchrun --nproc-per-node 2 -m megatron_cp_plugin.bench.decode --context 32768 131072 524288
    torchrun --nproc-per-node 2 -m megatron_cp_plugin.bench.decode --model --context 131072 524288 --batch 1 8
    torchrun --nproc-per-node 2 -m megatron_cp_plugin.bench.decode --model --profile --context 131072 --batch 1 \
        --decoders tree --eager-context

--model times whole generation steps of a GPTModel (Llama-3.1-8B shape by default, random bf16 weights) with
the static decode step (inference/static.py), graphed and eager, tree and ring; see `model_bench`. With
--profile the same configurations run under torch.profiler instead, each kernel of a step put in one part
(weight GEMMs, attention, RoPE and cache append, norms, exchange, merge, sampling, copies, other, idle) next to
the bytes it must read (bench/decode_profile.py).
Without it, the attention alone:

Llama-3.1-8B attention shape by default (32 heads, 8 KV heads, d = 128, 32 layers), b = 1, one new token,
bf16; the cache is split evenly over the ranks. A decode step is the attention of all --layers layers
launched back to back, as a model's forward launches them (the host runs ahead, so launch overhead hides
behind GPU work where the GPU is the bottleneck); every layer reads its own cache (--distinct caches cycled,
so no layer finds its KV in L2). Timing: barrier, synchronize, CUDA events around the step; the median of
--iters steps, the slowest rank counting. "(CUDA graph)" rows replay the same step captured as one graph,
as a serving engine runs decode; "cuDNN local" rows use the prefill kernel instead of split-KV
flash-decoding for the local step (what tree decoding used before kernels/flash_decode.py).
Byte formula in the header. floor_ms: the step's KV read at the GPU's memory bandwidth, measured at the start of
the run (inference/floor.memory_bandwidth: the higher of a copy and a read; the header gives both and the nominal;
--mem-bw overrides); x_floor = step_ms / floor_ms.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import megatron_cp_plugin as mcp
from megatron_cp_plugin.algos.ring_decode import ring_decode
from megatron_cp_plugin.algos.tree_decode import COLLECTIVE_VARIANTS, VARIANTS
from megatron_cp_plugin.kernels.flash_decode import Workspace
from megatron_cp_plugin.symmetric import unsupported_reason
from megatron_cp_plugin.bench._common import gather_max, init_distributed, not_fitting, time_ms, write_report
from megatron_cp_plugin.inference.floor import bandwidth_note, memory_bandwidth
from megatron_cp_plugin.kernels.local_attn import decode_fwd


def step_ms(step, *, iters: int, warmup: int = 3) -> float:
    """Median ms of step() (one decode step), every rank starting together; slowest rank."""
    def together():
        dist.barrier()
        torch.cuda.synchronize()
    return gather_max(time_ms(step, warmup=warmup, iters=iters, before=together))


def graphed(step, keep: list):
    """step captured as one CUDA graph (after a warm-up on a side stream); returns its replay, or None. The graph
    goes into `keep`, which the caller empties before destroying the process group: NCCL does not finish
    destroying a communicator while a graph that captured its collectives is alive (the hang seen on exit)."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        keep.append(g)
        return g.replay
    except Exception as e:  # noqa: BLE001 - report which method could not be captured, keep measuring the rest
        print(f"rank {dist.get_rank()}: CUDA graph capture failed: {type(e).__name__}: {e}", flush=True)
        return None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, nargs="+", default=[32768, 131072, 524288])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--distinct", type=int, default=4, help="distinct KV caches cycled over the layers")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--single-max", type=int, default=1 << 20, help="largest context the one-GPU baseline runs")
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--out", default="results/decode")
    p.add_argument("--mem-bw", type=float, default=None, metavar="TB/s", help="bandwidth of the floor")
    g = p.add_argument_group("--model: whole GPT decode steps")
    g.add_argument("--model", action="store_true", help="time the static decode step of a GPTModel")
    g.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    g.add_argument("--batch-max-context", type=int, default=131072, help="batches > 1 only up to this context")
    g.add_argument("--decoders", nargs="+", choices=("tree", "ring", "sdpa"), default=["tree", "ring"],
                   help="sdpa: torch's SDPA over the whole cache, the single-GPU anchor (CP = 1 rows only)")
    g.add_argument("--hidden", type=int, default=4096)
    g.add_argument("--ffn", type=int, default=14336)
    g.add_argument("--tokens", type=int, default=32,
                   help="greedy tokens of the token check; decode steps timed per configuration")
    g.add_argument("--eager-context", type=int, nargs="*", default=[131072], help="contexts also timed eagerly")
    g.add_argument("--check-context", type=int, default=16384, help="prompt of the graph-vs-eager token check")
    g.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    g.add_argument("--profile", action="store_true", help="per-kernel time of each configuration's step "
                   "instead of its latency (implies --model; bench/decode_profile.py)")
    g.add_argument("--profile-steps", type=int, default=5, help="steps measured under the profiler")
    g.add_argument("--variants", nargs="+", choices=VARIANTS, default=None,
                   help="tree merge variants timed side by side at P > 1 (default: the cost model's choice alone)")
    g.add_argument("--mlp", nargs="+", choices=("split", "whole"), default=None,
                   help="the step's MLPs split over the CP ranks or whole on each, each timed side by side at P > 1 "
                   "(default: the decoder's choice, split at P > 1; --profile takes the first)")
    g.add_argument("--peer-rounds", type=int, nargs="+", choices=(1, 2), default=None,
                   help="flag rounds of the NVLink peer kernels, each timed side by side at P > 1 where the 'peer' "
                   "merge and split MLPs alternate (symmetric.fence; default: the decoder's choice, 1 there)")
    g.add_argument("--pdl", choices=("on", "off", "both"), default="on",
                   help="programmatic dependent launch of the step's kernels (kernels/_launch.pdl; Hopper and "
                   "newer): both times each graphed row with it and again without ('graph-nopdl')")
    return p


def main(argv=None):
    a = parser().parse_args(argv)
    a.model = a.model or a.profile                              # --profile profiles the --model step
    rank, world, dev = init_distributed()
    if dev.type != "cuda" and not a.model:
        raise SystemExit("bench.decode needs GPUs (run it under torchrun on a GPU machine)")
    bw = memory_bandwidth(dev, None if a.mem_bw is None else a.mem_bw * 1e12)
    if a.pdl == "off":
        from megatron_cp_plugin.kernels import _launch
        _launch.PDL = False                     # before any kernel: the whole run without it
    if a.model and a.profile:
        from megatron_cp_plugin.bench.decode_profile import profile_bench
        profile_bench(a, rank, world, dev, bw)
    elif a.model:
        from megatron_cp_plugin.bench.decode_model import model_bench
        model_bench(a, rank, world, dev, bw)
    else:
        attention_bench(a, rank, world, dev, bw)
    # Exit cleanly: every graph is gone (see `graphed`), the last kernels are done, and no rank destroys the
    # communicator while another is still writing its report or in a collective.
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


GRAPHED = ("tree allgather", "tree allreduce2", "tree allreduce3", "ring-decode", "local shard only (no merge)")


def attention_bytes(a, context: int, world: int) -> tuple[int, int]:
    """(bytes each rank needs for the sharded methods at `context`, bytes rank 0 needs for the one-GPU
    baseline), from arithmetic, with decode_model's margin (MARGIN_FRACTION, MARGIN_BYTES): the --distinct K, V
    caches of context / P tokens (2 x h_kv x d x 2 B a token) and, for ring decoding at P > 1, one layer's
    received shard (two in flight for P > 2), once eagerly and once more in its graph's pool."""
    from megatron_cp_plugin.bench.decode_model import MARGIN_BYTES, MARGIN_FRACTION

    tok = 2 * a.kv_heads * a.head_dim * 2
    s = context // world
    ring = (0 if world == 1 else 1 if world == 2 else 2) * s * tok * (1 if a.no_graphs else 2)
    return tuple(int(x * (1 + MARGIN_FRACTION) + MARGIN_BYTES) for x in (a.distinct * s * tok + ring,
                                                                          a.distinct * context * tok))


def attention_bench(a, rank: int, world: int, dev, bw: float) -> None:
    from megatron_cp_plugin.bench.decode_model import graph_refusal

    dtype = torch.bfloat16
    rows, graphs = [], []
    no_graph = None if a.no_graphs else graph_refusal(dev)       # gloo (ranks sharing a GPU): eager only
    for n in a.context:
        s = n // world
        need, need_single = attention_bytes(a, n, world)
        why = not_fitting(need, dev)                           # every rank, before anything of n is allocated
        if why:
            if rank == 0:
                rows.append({"context": n, "method": "every method", "P": world, "not_run": why})
                print(f"{n}: {why}", flush=True)
            continue
        q = torch.randn(1, 1, a.heads, a.head_dim, device=dev, dtype=dtype,
                        generator=torch.Generator(device=dev).manual_seed(n))
        g = torch.Generator(device=dev).manual_seed(n + rank)
        caches = [tuple(torch.randn(1, s, a.kv_heads, a.head_dim, device=dev, dtype=dtype, generator=g)
                        for _ in range(2)) for _ in range(a.distinct)]

        def layers(fn):
            return lambda: [fn(*caches[i % a.distinct]) for i in range(a.layers)]

        methods = {f"tree {var}": layers(lambda k, v, var=var: mcp.tree_decode(q, k, v, variant=var, validate=False))
                   for var in COLLECTIVE_VARIANTS}
        if world > 1 and unsupported_reason(None, dev, collective=True) is None:
            ws = Workspace()                                    # keeps the symmetric buffers of "peer"
            methods["tree peer"] = layers(lambda k, v: mcp.tree_decode(q, k, v, variant="peer", validate=False,
                                                                       workspace=ws))
        methods["tree allreduce2, cuDNN local"] = layers(
            lambda k, v: mcp.tree_decode(q, k, v, validate=False, backend="cudnn"))
        methods["ring-decode"] = layers(lambda k, v: ring_decode(q, k, v))
        methods["local shard only (no merge)"] = layers(lambda k, v: decode_fwd(q, k, v))
        small = torch.zeros(a.heads * (a.head_dim + 1), device=dev)
        methods["all_reduce of (o, lse) bytes only"] = lambda: [dist.all_reduce(small) for _ in range(a.layers)]
        if not a.no_graphs and no_graph is None:
            for name in GRAPHED + (("tree peer",) if "tree peer" in methods else ()):
                replay = graphed(methods[name], graphs)
                if replay is not None:
                    methods[name + " (CUDA graph)"] = replay
        res = {name: step_ms(fn, iters=a.iters) for name, fn in methods.items()}
        methods.clear()
        graphs.clear()                                     # free the graphs (and with them their NCCL work)
        caches.clear()                                     # free this context's shards
        why = not_fitting(need_single if rank == 0 else 0, dev) if n <= a.single_max else None
        if why and rank == 0:
            rows += [{"context": n, "method": name, "P": 1, "not_run": why} for name in ("one GPU", "one GPU, cuDNN")]
            print(f"{n} one GPU: {why}", flush=True)
        if n <= a.single_max and not why:
            # One GPU holding the whole cache (rank 0; the others wait at the barrier inside step_ms).
            full = [tuple(torch.randn(1, n, a.kv_heads, a.head_dim, device=dev, dtype=dtype) for _ in range(2))
                    for _ in range(a.distinct)] if rank == 0 else None
            for name, kw in (("one GPU", {}), ("one GPU, cuDNN", {"backend": "cudnn"})):
                fn = ((lambda kw=kw: [decode_fwd(q, *full[i % a.distinct], **kw) for i in range(a.layers)])
                      if rank == 0 else (lambda: None))
                res[name] = step_ms(fn, iters=a.iters)
            del full
        if rank == 0:
            ring = res["ring-decode"]
            for name, t in res.items():
                P = 1 if name.startswith("one GPU") else world
                # The floor: every layer's K, V shard (context / P tokens) read once from HBM.
                floor = a.layers * -(-n // P) * 2 * a.kv_heads * a.head_dim * 2 / bw * 1e3
                rows.append({"context": n, "method": name, "P": P, "step_ms": t, "layer_us": t / a.layers * 1e3,
                             "ring_decode_over_this": ring / t, "floor_ms": floor, "x_floor": t / floor})
            if no_graph:
                rows += [{"context": n, "method": f"{name} (CUDA graph)", "P": world, "not_run": no_graph}
                         for name in GRAPHED]
        torch.cuda.empty_cache()
    if rank == 0:
        name = torch.cuda.get_device_name(dev)
        kv_bytes = 2 * a.kv_heads * a.head_dim * 2
        header = (f"decode step: b=1, 1 new token, h={a.heads}, h_kv={a.kv_heads}, d={a.head_dim}, bf16, "
                  f"{a.layers} layers back to back, {world} x {name}; median of {a.iters}. Bytes per rank per "
                  f"layer: tree moves (o, lse) = b*h*(d+1)*4 = {a.heads * (a.head_dim + 1) * 4} B per all-reduce; "
                  f"ring-decode moves (P-1) shards of context/P * 2*h_kv*d*2 = {kv_bytes} B per token; the local "
                  f"step reads context/P * {kv_bytes} B. floor_ms = layers * context/P * {kv_bytes} B / "
                  f"{bandwidth_note(dev, bw)} (the KV read alone); x_floor = step_ms / floor_ms.")
        print(write_report(rows, a.out, header, plot=("context", "step_ms", "method")), flush=True)


if __name__ == "__main__":
    main()
