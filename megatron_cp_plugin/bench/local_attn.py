"""Local block-attention kernels side by side on one GPU (the backends of kernels/local_attn.py), plus the
(o, lse) merge's bandwidth.

    python -m megatron_cp_plugin.bench.local_attn --seq 16384 65536

Per backend and mask: fwd and fwd+bwd ms and TFLOP/s (formula printed), and the ratio to cuDNN. "causal_strict"
(Attention2D's blocks without their diagonal) counts the causal FLOPs:

    python -m megatron_cp_plugin.bench.local_attn --seq 65536 --masks causal causal_strict
The merge row: bytes = o fp32 read+write (8) + o_blk bf16 read (2) per element, lse ignored.
Memory: each length's need (`need`: its q, k, v, dO and one kernel's fwd+bwd) is checked against what the device
has free before anything of it is allocated; a length that does not fit is one row with `not_run` (the reason,
also printed) and the run goes on. Without a GPU it runs on the CPU (the math backend alone), for tests.
"""
from __future__ import annotations

import argparse

import torch

from megatron_cp_plugin.bench._common import FLOP_FORMULA, attention_flop, not_fitting, time_ms, write_report
from megatron_cp_plugin.bench.cp_attention import attention_need, input_bytes
from megatron_cp_plugin.kernels.local_attn import BACKENDS, MASKS, unsupported, block_bwd, block_fwd
from megatron_cp_plugin.kernels.merge import merge_


def need(s: int, h: int, hk: int, d: int, elem: int) -> float:
    """Bytes one length allocates: q, k, v, dO and one backend's fwd+bwd (cp_attention.attention_need's "single":
    o, lse, dq, dk, dv, the kernel's fp32 dQ accumulator, times its margin). The merge row's fp32 o, o_blk, lse and
    merge_'s cast of o_blk (10 bytes per element in bf16) take less than that (12 bytes per element at least)."""
    return input_bytes(s, h=h, hk=hk, d=d, elem=elem) + attention_need("single", s, 1, h=h, hk=hk, d=d, elem=elem)


def _length(a, s, hk, dev, dtype) -> list[dict]:
    """The rows of one sequence length: every backend and mask, then the merge."""
    rows = []
    q, k, v, do = (torch.randn(1, s, n, a.head_dim, device=dev, dtype=dtype) for n in (a.heads, hk, hk, a.heads))
    for mask in a.masks:
        causal = mask != "none"
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
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[16384, 65536])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--masks", nargs="+", default=["causal", "none"], choices=MASKS)
    p.add_argument("--math-max-seq", type=int, default=8192, help="skip the math backend above this length")
    p.add_argument("--out", default="results/local_attn")
    a = p.parse_args(argv)
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype, hk = torch.bfloat16, a.kv_heads or a.heads
    rows = []
    for s in a.seq:
        why = not_fitting(need(s, a.heads, hk, a.head_dim, dtype.itemsize), dev)
        if why:
            rows.append({"S": s, "not_run": why})
            print(f"local_attn: S={s}: {why}")
            continue
        rows += _length(a, s, hk, dev, dtype)       # its tensors are gone when it returns, before the next check
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU"
    header = (f"local_attn: b=1 h={a.heads} h_kv={hk} d={a.head_dim} bf16 on {name}. "
              f"{FLOP_FORMULA}. fwd_bwd_x_first: time / the first backend's (cudnn); GB/s: the merge's bandwidth.")
    print(write_report(rows, a.out, header))


if __name__ == "__main__":
    main()
