"""Where each algorithm's fwd+bwd goes on every rank of a real process group: torch.profiler around the calls of
`megatron-cp-bench attention` (our algorithms and PyTorch's native CP), per rank. Issue 34 item 2 asks why
Attention2D-NO's fwd+bwd over NVLink at P = 2 is 1.02x PyTorch's native CP while one rank's replayed work equals
ring's (docs/performance.md): this says which stream waited and for how long.

    torchrun --nproc-per-node 2 scripts/profile_attention.py --seq 131072 --out dir
    torchrun --nproc-per-node 2 scripts/profile_attention.py --algos ring attention2d-no --trace ring --out dir

Per algorithm and rank (dir/profile_attention_r<rank>.txt; rank 0 prints its own):
  wall      ms per fwd+bwd (CUDA events; perf_counter on CPU ranks)
  compute   the union of the kernels on every stream but NCCL's, ms per fwd+bwd: how long a compute stream ran
  idle      wall - compute: nothing computed (a wait for a collective, launch gaps)
  nccl      the union of NCCL's kernels, and the part of it that ran beside compute (NCCL's kernels take SMs)
  streams   busy ms per stream, then the top kernels by time with their launches per fwd+bwd.
On CPU (gloo) there are no kernels: wall and the top aten ops by self CPU time. --trace names the algorithms whose
Chrome trace every rank writes (dir/trace_<algo>_r<rank>.json): one rank's wait is the other's late collective.
"""
from __future__ import annotations

import argparse
import collections
import math
import os
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from megatron_cp_plugin.bench._common import init_distributed
from megatron_cp_plugin.bench.anchors import Unavailable, builders
from megatron_cp_plugin.bench.cp_attention import _cp
from megatron_cp_plugin.bench.decode_profile import busy_us

NCCL = "nccl"


def busy(intervals) -> float:
    """Length of the union of the (start, end) intervals (decode_profile's, unclipped)."""
    return busy_us(list(intervals), -math.inf, math.inf)


def covered(a, b) -> float:
    """Length of union(a) that union(b) covers too: |A| + |B| - |A u B|."""
    return busy(a) + busy(b) - busy(list(a) + list(b))


def summarize(kernels, iters: int, wall_ms: float) -> dict:
    """kernels [(name, stream, start_us, end_us)] of `iters` fwd+bwd calls -> the per-call figures of the docstring."""
    streams = collections.defaultdict(list)
    time_by, calls_by = collections.Counter(), collections.Counter()
    for name, stream, s, e in kernels:
        streams[NCCL if NCCL in name.lower() else stream].append((s, e))
        time_by[name[:100]] += (e - s) / 1e3 / iters
        calls_by[name[:100]] += 1 / iters
    comp = [iv for st, ivs in streams.items() if st != NCCL for iv in ivs]
    compute = busy(comp) / 1e3 / iters
    return {"wall_ms": wall_ms, "compute_ms": compute, "idle_ms": wall_ms - compute,
            "nccl_ms": busy(streams.get(NCCL, [])) / 1e3 / iters,
            "nccl_beside_compute_ms": covered(streams.get(NCCL, []), comp) / 1e3 / iters,
            "kernels": len(kernels) / iters,
            "streams": {str(st): busy(ivs) / 1e3 / iters for st, ivs in streams.items()},
            "top": [(n, t, calls_by[n]) for n, t in time_by.most_common(12)]}


def report(name: str, rank: int, r: dict) -> str:
    head = f"{name} rank {rank}: wall {r['wall_ms']:.2f} ms a fwd+bwd"
    if r.get("kernels"):
        head += (f", compute {r['compute_ms']:.2f}, idle {r['idle_ms']:.2f}, nccl {r['nccl_ms']:.2f} (beside "
                 f"compute {r['nccl_beside_compute_ms']:.2f}), {r['kernels']:.0f} kernels; streams "
                 + ", ".join(f"{s}: {t:.2f}" for s, t in r["streams"].items()))
    return "\n".join([head] + [f"    {t:9.3f} ms  x{c:.0f}  {n}" for n, t, c in r["top"]])


def profile_one(fwd_bwd, iters: int, cuda: bool, trace: str | None):
    """`iters` fwd+bwd under the profiler after 3 warm-ups: the summary dict."""
    for _ in range(3):
        fwd_bwd()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        # The ranks start together inside the profiler too: its start-up differs per rank (the first algorithm's
        # rank 0 measured 69 ms of idle waiting for rank 1, 2026-11-28, where rank 1 measured 3).
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev[0].record()
        t0 = time.perf_counter()
        for _ in range(iters):
            fwd_bwd()
        if cuda:
            ev[1].record()
            torch.cuda.synchronize()
        wall = ev[0].elapsed_time(ev[1]) if cuda else (time.perf_counter() - t0) * 1e3
    if trace:
        prof.export_chrome_trace(trace)
    events = prof.events()
    kernels = [(e.name, getattr(e, "device_resource_id", None), e.time_range.start, e.time_range.end)
               for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    r = summarize(kernels, iters, wall / iters)
    if not kernels:                                   # CPU ranks: the ops instead
        ops, calls = collections.Counter(), collections.Counter()
        for e in events:
            if e.name.startswith("aten::"):
                ops[e.name] += e.self_cpu_time_total / 1e3 / iters
                calls[e.name] += 1 / iters
        r["top"] = [(n, t, calls[n]) for n, t in ops.most_common(12)]
    return r


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=131072)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--algos", nargs="+", default=["ring", "ring-te", "attention2d-no", "allgather",
                                                  "torch-cp-allgather-cudnn"])
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--trace", nargs="*", default=[], help="algorithms whose Chrome trace every rank writes")
    p.add_argument("--out", default="profile_attention")
    a = p.parse_args(argv)
    rank, world, dev = init_distributed()
    cuda = dev.type == "cuda"
    os.makedirs(a.out, exist_ok=True)
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device=dev).manual_seed(a.seq)
    q, k, v, do = (torch.randn(1, a.seq, a.heads, a.head_dim, device=dev, dtype=dtype, generator=g) for _ in range(4))
    anchors = builders(True)
    lines = []
    for name in a.algos:
        closer = None
        try:
            if name in anchors:
                fwd, fwd_bwd, closer = anchors[name](q, k, v, do)
            else:
                fwd, fwd_bwd, _ = _cp(name, q, k, v, do, True, dist.group.WORLD)
        except Unavailable as e:
            lines.append(f"{name}: not run ({e})")
            continue
        trace = f"{a.out}/trace_{name}_r{rank}.json" if name in a.trace else None
        lines.append(report(name, rank, profile_one(fwd_bwd, a.iters, cuda, trace)))
        if closer is not None:
            closer.close()
        del fwd, fwd_bwd
        if cuda:
            torch.cuda.empty_cache()
        dist.barrier()
    text = "\n".join(lines) + "\n"
    with open(f"{a.out}/profile_attention_r{rank}.txt", "w") as f:
        f.write(f"{world} ranks, S = {a.seq}, {a.heads} heads, d = {a.head_dim}, causal, {dtype}, {a.iters} "
                f"fwd+bwd profiled after 3 warm-ups\n" + text)
    if rank == 0:
        print(text, end="", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
