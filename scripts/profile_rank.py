"""Where one rank's time goes: torch.profiler over a replayed rank (bench/rank_replay.py), per CUDA kernel.

    python scripts/profile_rank.py --seq-len 131072 --cp 16 --algos ring burst attention2d-no:4x4 --out dir

Per (algo, P): the rank's fwd+bwd time by kernel name (summed over the calls of one fwd+bwd, top --top), the
attention kernels' share and everything else grouped (elementwise, copies, reductions), with the launch
counts. Writes dir/profile_<algo>_<P>.txt and prints a summary line per run.
"""
from __future__ import annotations

import argparse
import collections
import os

import torch
from torch.profiler import ProfilerActivity, profile

from megatron_cp_plugin.bench.rank_replay import RankReplay, _shards, count_launches


def classify(name: str) -> str:
    n = name.lower()
    if any(x in n for x in ("fmha", "flash", "cudnn", "attn", "sm90_xmma", "cutlass")):
        return "attention"
    if n.startswith(("memcpy", "memset")):
        return "memcpy/memset"
    if "copy" in n or "cat" in n:
        return "copy/cast"
    if "reduce" in n or "sum" in n or "topk" in n or "sort" in n:
        return "reduce/topk"
    return "elementwise/other"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--cp", type=int, nargs="+", default=[16])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=32)
    p.add_argument("--algos", nargs="+", default=["ring", "burst", "attention2d-no:4x4", "attention2d-o:4x4"])
    p.add_argument("--rank", type=int, default=None, help="default: P // 2")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default="results/profile")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dev = torch.device("cuda")
    for P in a.cp:
        shards = _shards(a.seq_len, P, a.heads, a.kv_heads, 128, dev, torch.bfloat16)
        for spec in a.algos:
            algo, _, g = spec.partition(":")
            grid = tuple(int(x) for x in g.split("x")) if g else None
            if grid and grid[0] * grid[1] != P:
                continue
            rank = a.rank if a.rank is not None else P // 2
            rep = RankReplay(algo, P, rank, *shards, grid=grid)
            for _ in range(3):
                rep()
            torch.cuda.synchronize()
            counts = count_launches(rep)
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            ev[0].record()
            rep(mark=ev[1].record)
            ev[2].record()
            ev[2].synchronize()
            fwd, bwd = ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2])
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                rep()
                torch.cuda.synchronize()
            per, n = collections.defaultdict(float), collections.Counter()
            cats, catn = collections.defaultdict(float), collections.Counter()
            busy = 0.0
            for e in prof.events():
                if e.device_type != torch.autograd.DeviceType.CUDA:
                    continue
                us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                per[e.name] += us
                n[e.name] += 1
                cats[classify(e.name)] += us
                catn[classify(e.name)] += 1
                busy += us
            lines = [f"{algo} {g or '-'} P={P} S={a.seq_len} h/hk={a.heads}/{a.kv_heads} rank={rank}: fwd {fwd:.2f} ms "
                     f"bwd {bwd:.2f} ms (events), kernel busy {busy / 1e3:.2f} ms, counts {counts}"]
            lines += [f"  {c:20s} {t / 1e3:9.3f} ms {catn[c]:6d} launches" for c, t in
                      sorted(cats.items(), key=lambda x: -x[1])]
            lines.append("  top kernels:")
            lines += [f"  {t / 1e3:9.3f} ms {n[k]:5d}x  {k[:150]}" for k, t in
                      sorted(per.items(), key=lambda x: -x[1])[:a.top]]
            with profile(activities=[ProfilerActivity.CPU]) as cpu:
                rep()
                torch.cuda.synchronize()
            lines.append("  host (self CPU time of one fwd+bwd, top ops):")
            lines += ["  " + line for line in cpu.key_averages().table(sort_by="self_cpu_time_total",
                                                                     row_limit=a.top).splitlines()]
            text = "\n".join(lines)
            print(text, flush=True)
            with open(os.path.join(a.out, f"profile_{algo}{('_' + g) if g else ''}_{P}.txt"), "w") as f:
                f.write(text + "\n")
            del rep
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
