"""Local block-attention kernels side by side on one GPU (the backends of kernels/local_attn.py), plus the
(o, lse) merge's bandwidth.

    python -m megatron_cp_plugin.bench.local_attn --seq 16384 65536

Per backend and mask: fwd and fwd+bwd ms and TFLOP/s (formula printed), and the ratio to cuDNN.
The merge row: bytes = o fp32 read+write (8) + o_blk bf16 read (2) per element, lse ignored.
"""
from __future__ import annotations

import argparse

import torch

from megatron_cp_plugin.bench._common import FLOP_FORMULA, attention_flop, time_ms, write_report
from megatron_cp_plugin.kernels.local_attn import BACKENDS, unsupported, block_bwd, block_fwd
from megatron_cp_plugin.kernels.merge import merge_


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[16384, 65536])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--masks", nargs="+", default=["causal", "none"])
    p.add_argument("--math-max-seq", type=int, default=8192, help="skip the math backend above this length")
    p.add_argument("--out", default="results/local_attn")
    a = p.parse_args(argv)
    dev, dtype, hk = torch.device("cuda"), torch.bfloat16, a.kv_heads or a.heads
    rows = []
    for s in a.seq:
        q, k, v, do = (torch.randn(1, s, n, a.head_dim, device=dev, dtype=dtype) for n in (a.heads, hk, hk, a.heads))
        for mask in a.masks:
            causal = mask == "causal"
            base = {}
            for be in BACKENDS:
                if unsupported(be, dev, dtype, a.head_dim) or (be == "math" and s > a.math_max_seq):
                    continue
                fwd = lambda: block_fwd(q, k, v, mask=mask, backend=be)  # noqa: E731
                t1 = time_ms(fwd)
                t2 = time_ms(lambda: block_bwd(do, q, k, v, *fwd(), mask=mask, backend=be))
                base = base or {"fwd": t1, "fwd_bwd": t2}
                rows.append({"S": s, "mask": mask, "backend": be, "fwd_ms": t1, "fwd_bwd_ms": t2,
                             "fwd_TFLOPs": attention_flop(1, s, a.heads, a.head_dim, causal, False) / t1 / 1e9,
                             "fwd_bwd_TFLOPs": attention_flop(1, s, a.heads, a.head_dim, causal, True) / t2 / 1e9,
                             "fwd_bwd_x_first": t2 / base["fwd_bwd"], "GB/s": float("nan")})
        o = torch.randn(1, s, a.heads, a.head_dim, device=dev)
        lse = torch.randn(1, a.heads, s, device=dev)
        ob, lb = o.to(dtype), lse.clone()
        t = time_ms(lambda: merge_(o, lse, ob, lb))
        rows.append({"S": s, "mask": "-", "backend": "merge_", "fwd_ms": t, "fwd_bwd_ms": float("nan"),
                     "fwd_TFLOPs": float("nan"), "fwd_bwd_TFLOPs": float("nan"),
                     "fwd_bwd_x_first": float("nan"), "GB/s": 10 * o.numel() / t / 1e6})
    header = (f"local_attn: b=1 h={a.heads} h_kv={hk} d={a.head_dim} bf16 on {torch.cuda.get_device_name()}. "
              f"{FLOP_FORMULA}. fwd_bwd_x_first: time / the first backend's (cudnn); GB/s: the merge's bandwidth.")
    print(write_report(rows, a.out, header))


if __name__ == "__main__":
    main()
