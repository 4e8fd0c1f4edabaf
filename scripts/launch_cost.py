"""Host time per call of the local pieces a rank launches (launch-bound at 2k tokens a rank): block_fwd, block_bwd
(cuDNN and FA2-in-torch), merge_, accumulate_, surrogate_out, a plain add_, at tiny shapes so the GPU never waits.

    python scripts/launch_cost.py
"""
from __future__ import annotations

import time

import torch

from megatron_cp_plugin.kernels import local_attn, merge


def per_call_us(fn, n=200):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    total = (time.perf_counter() - t) / n * 1e6
    return host, total


def main():
    dev, dt = torch.device("cuda"), torch.bfloat16
    q, k, v, do = (torch.randn(1, 256, 32, 128, device=dev, dtype=dt) for _ in range(4))
    o, lse = local_attn.block_fwd(q, k, v, mask="causal")
    acc = torch.zeros(1, 256, 32, 128, device=dev)
    lse_acc = torch.zeros(1, 32, 256, device=dev)
    delta = local_attn.attention_delta(do, o)
    cases = {}
    for be in ("cudnn", "flash"):
        cases[f"block_fwd {be}"] = lambda be=be: local_attn.block_fwd(q, k, v, mask="causal", backend=be)
        cases[f"block_bwd {be}"] = lambda be=be: local_attn.block_bwd(do, q, k, v, o, lse, mask="causal", backend=be)
        cases[f"raw aten fwd {be}"] = lambda be=be: local_attn._FWD[be](q, k, v, True, 0.1, 0)
        cases[f"raw aten bwd {be}"] = lambda be=be: local_attn._BWD[be](do, q, k, v, o, lse, True, 0.1, 0)
    cases["merge_"] = lambda: merge.merge_(acc, lse_acc, o, lse)
    cases["accumulate_"] = lambda: merge.accumulate_(acc, o)
    cases["add_ (mixed dtype)"] = lambda: acc.add_(o)
    cases["surrogate_out"] = lambda: local_attn.surrogate_out(do, delta)
    for name, fn in cases.items():
        try:
            host, total = per_call_us(fn)
            print(f"launch_cost: {name:22s} host {host:7.1f} us/call, with GPU {total:7.1f} us/call", flush=True)
        except Exception as e:  # a backend missing on this machine
            print(f"launch_cost: {name:22s} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)


if __name__ == "__main__":
    main()
