# old kernel vs sliced v1 (package) vs sliced v2 (marks; dbg/s30/surrogate_v2.py), interleaved in one process,
# then burst's replayed rank 0 / 5 at 128k P=64: surrogate kernel time per fwd+bwd, old vs v1 candidates
import importlib.util, statistics, torch
from torch.profiler import ProfilerActivity, profile
from megatron_cp_plugin.bench._common import time_ms
from megatron_cp_plugin.bench.rank_replay import RankReplay, _shards
from megatron_cp_plugin.algos import burst
from megatron_cp_plugin.kernels import local_attn, surrogate as v1
def load(name, path):
    spec = importlib.util.spec_from_file_location(f"megatron_cp_plugin.kernels.{name}", path)
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
old, v2 = load("surrogate_old", "dbg/s30/surrogate_old.py"), load("surrogate_v2", "dbg/s30/surrogate_v2.py")
K = dict(select="keys", index_bits=32)
cands = {
    "old default": lambda do, de: old.surrogate_out(do, de),
    "old int32": lambda do, de: old.surrogate_out_triton(do, de, index_bits=32),
    "v1 W64 4w 16r": lambda do, de: v1.surrogate_out_triton(do, de, slice_cols=64, num_warps=4, rows_per_program=16, programs_per_sm=32, **K),
    "v1 W64 1w 4r": lambda do, de: v1.surrogate_out_triton(do, de, slice_cols=64, num_warps=1, rows_per_program=4, programs_per_sm=32, **K),
    "v1 W64 2w 8r": lambda do, de: v1.surrogate_out_triton(do, de, slice_cols=64, num_warps=2, rows_per_program=8, programs_per_sm=32, **K),
    "v1 W32 2w 16r": lambda do, de: v1.surrogate_out_triton(do, de, slice_cols=32, num_warps=2, rows_per_program=16, programs_per_sm=32, **K),
    "v1 W32 1w 8r": lambda do, de: v1.surrogate_out_triton(do, de, slice_cols=32, num_warps=1, rows_per_program=8, programs_per_sm=32, **K),
    "v2 W64 1w 4r": lambda do, de: v2.surrogate_out_triton(do, de, slice_cols=64, num_warps=1, rows_per_program=4, programs_per_sm=32, **K),
    "v2 W32 2w 16r": lambda do, de: v2.surrogate_out_triton(do, de, slice_cols=32, num_warps=2, rows_per_program=16, programs_per_sm=32, **K),
}
dev = torch.device("cuda")
def rel_err(do, out, delta):
    got = (do.double() * out.double()).sum(-1).transpose(1, 2)
    return ((got - delta.double()).abs() / delta.double().abs().clamp_min(1e-30)).max().item()
for n in (524288, 131072, 65536):
    do = torch.randn(1, n // 32, 32, 128, device=dev, dtype=torch.bfloat16)
    delta = (do.float() * torch.randn_like(do).float()).sum(-1).transpose(1, 2).contiguous()
    ref = cands["v1 W64 4w 16r"](do, delta)
    for k, f in cands.items():
        o = f(do, delta)
        print(f"rows {n} {k}: rel err {rel_err(do, o, delta):.2g}, equal to v1 W64: {torch.equal(o, ref)}, "
              f"entries equal {(o == ref).float().mean().item():.5f}", flush=True)
    ts = {k: [] for k in cands}
    for _ in range(5):
        for k, f in cands.items():
            ts[k].append(time_ms(lambda: f(do, delta), warmup=3, iters=30))
    for k, v in ts.items():
        print(f"rows {n} {k}: median {statistics.median(v):.4f} ms (min {min(v):.4f}, max {max(v):.4f})", flush=True)
def prof(rep):
    with profile(activities=[ProfilerActivity.CUDA]) as pr:
        rep(); torch.cuda.synchronize()
    ev = [e for e in pr.events() if e.device_type.name == "CUDA"]
    return sum(e.device_time for e in ev if "surrogate" in e.name) / 1e3, sum(e.device_time for e in ev) / 1e3
shards = _shards(131072, 64, 32, 32, 128, dev, torch.bfloat16)
for rank in (0, 5):
    rep = RankReplay("burst", 64, rank, *shards)
    for k in ("old default", "v1 W64 4w 16r", "v1 W32 2w 16r", "old default", "v1 W64 4w 16r", "v1 W32 2w 16r"):
        local_attn.surrogate_out = burst.surrogate_out = cands[k]
        for _ in range(2): rep()
        r = [prof(rep) for _ in range(3)]
        print(f"rank {rank} {k}: surrogate {' '.join(f'{x[0]:.3f}' for x in r)} ms, busy {' '.join(f'{x[1]:.2f}' for x in r)} ms", flush=True)
