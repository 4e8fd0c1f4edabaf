"""Training RoPE in one kernel each way (kernels/rope.py) against megatron-core's unfused RoPE, on one GPU.

    megatron-cp-bench rope --shapes 32768x32x80 32768x40x128 --iters 20

Per shape s x h x d (tokens of one rank x heads x head dim, b = 1; defaults: GPT-3 2.7B and 13B at 64k over CP = 2),
q as megatron-core hands it to RoPE (a strided view of the fused QKV projection's output), bf16: median ms of the
forward and of forward + backward for megatron-core's `_apply_rotary_pos_emb_bshd` and for `fused_rope`, the
kernels each launches (torch.profiler), and each over the memory floor (bytes read and written once each way,
at the copy bandwidth measured in the same run: a 1 GiB device-to-device copy). Without a GPU it says so and
exits 0.
"""
from __future__ import annotations

import argparse

import torch

from megatron_cp_plugin.bench._common import time_ms, write_report
from megatron_cp_plugin.bench.norm import _kernels


def main(argv=None):
    p = argparse.ArgumentParser(prog="megatron-cp-bench rope", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["32768x32x80", "32768x40x128"], help="s x h x d")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="results/rope")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("megatron-cp-bench rope: no GPU here; the kernel's comparison needs one (nothing run)")
        return 0
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from megatron_cp_plugin.inference.floor import copy_bandwidth
    from megatron_cp_plugin.kernels.rope import fused_rope

    gbps, rows = copy_bandwidth(torch.device("cuda")) / 1e9, []
    for shape in a.shapes:
        s, h, d = (int(x) for x in shape.split("x"))
        qkv = torch.randn(s, 1, h, 3 * d, device="cuda", dtype=torch.bfloat16)
        t = qkv[..., :d].detach().requires_grad_(True)            # megatron-core's q: a view of QKV
        inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32, device="cuda") / d)
        f = torch.arange(s, dtype=torch.float32, device="cuda")[:, None] * inv
        freqs = torch.cat([f, f], -1)[:, None, None, :]
        grad = torch.randn(s, 1, h, d, device="cuda", dtype=torch.bfloat16)
        floor_ms = 2 * t.numel() * 2 / gbps / 1e6                  # read t once, write the output once
        for impl, fn in (("megatron-core unfused", lambda: _apply_rotary_pos_emb_bshd(t, freqs)),
                         ("fused_rope (Triton)", lambda: fused_rope(t, freqs))):
            with torch.no_grad():
                fwd = time_ms(fn, warmup=3, iters=a.iters)
                k_fwd = _kernels(fn)
            both = time_ms(lambda: fn().backward(grad), warmup=3, iters=a.iters)
            rows.append({"s": s, "h": h, "d": d, "impl": impl, "fwd_ms": round(fwd, 4),
                         "fwd_bwd_ms": round(both, 4), "kernels_fwd": k_fwd,
                         "kernels_fwd_bwd": _kernels(lambda: fn().backward(grad)),
                         "fwd_x_floor": round(fwd / floor_ms, 2), "fwd_bwd_x_floor": round(both / (2 * floor_ms), 2)})
            print(rows[-1], flush=True)
    header = (f"RoPE of q [s, 1, h, d] bf16 (a strided view of [s, 1, h, 3d], as megatron-core's QKV split gives it) "
              f"on {torch.cuda.get_device_name()}: median ms of {a.iters} calls, forward and forward + backward; "
              f"kernels per call (torch.profiler); x_floor: over reading and writing the tensor once each way at "
              f"{gbps:.0f} GB/s (a 1 GiB copy, this run).")
    print(write_report(rows, a.out, header))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
