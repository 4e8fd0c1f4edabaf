"""Memory planner: per-GPU bytes of a GPT config under each parallel layout, and which layouts fit.

    megatron-cp-bench plan --config configs/gpt3-175b.toml --gpus 64 --gpu-mem 80
    megatron-cp-bench plan --config configs/gpt3-13b.toml --gpus 2 --gpu-mem 141 --seq-length 32768 --json out.json

The arithmetic (the layouts, the terms, the formulas) is megatron_cp_plugin/cost/memory.py and
cost/memory_terms.py; this module is its command line and keeps the names other code imports from it.
"""
from __future__ import annotations

import dataclasses
import json
import sys

from ..cost.memory import (  # noqa: F401
    COUNTS, GiB, Estimate, Layout, Model, PREFERENCE, REPORTED_GIB, ZERO_LAYOUTS, estimate, fit, layouts, plan,
    recommend, recommendation_line, recommendations, reported_gib, static_bytes)
from ..training.memory_check import model_from_args  # noqa: F401  (reads the trainer's flags)


def main(argv=None) -> int:
    from .. import devices
    from ..training.config import add_run_args, build_parser, parse_with_configs

    p = add_run_args(build_parser(__doc__))
    p.add_argument("--gpus", type=int, required=True, help="GPUs of the job (CP group x pipeline stages)")
    p.add_argument("--gpu-mem", type=float, default=None,
                   help="memory per GPU in GiB (default: what this machine's GPU reports, e.g. 139.8 on an H200; "
                        "required without a GPU)")
    p.add_argument("--headroom", type=float, default=4.0,
                   help="GiB per GPU kept free for the CUDA context, NCCL and allocator slack (default 4)")
    p.add_argument("--fused-adam", action="store_const", const=True, default=None,
                   help="TransformerEngine or Apex is installed where the run trains: Megatron's FusedAdam keeps no "
                        "temporaries in any layout (default: megatron-cp-pretrain's torch fused Adam for ddp and "
                        "zero1, torch's foreach Adam under Megatron-FSDP, an fp32 temporary per parameter stepped)")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = parse_with_configs(p, argv)
    mem, where = args.gpu_mem, "--gpu-mem"
    if mem is None:
        mem, where = devices.gpu_capacity_gib(), "as this machine's GPU reports"
        if mem is None:
            raise SystemExit("megatron-cp-bench plan: --gpu-mem is required on a machine without a GPU")
    if args.gpus < 1 or mem <= 0:
        raise SystemExit("megatron-cp-bench plan: --gpus and --gpu-mem must be positive")
    m = model_from_args(args)
    rows = plan(m, args.gpus, mem, args.headroom, args.fused_adam)
    print(f"plan: {m.params / 1e9:.2f}B parameters ({m.layers} layers, hidden {m.hidden}, heads {m.heads}/"
          f"{m.groups}, ffn {m.ffn}, vocab {m.vocab}), sequence {m.seq} x micro-batch {m.micro_batch}, "
          f"{'bf16' if m.bf16 else 'fp32'}, --context-parallel-algo {m.algo}; {args.gpus} GPUs x {mem:.4g} GiB "
          f"({where}), {args.headroom:g} GiB headroom; GiB per GPU")
    cols = ("layout", "CP", "tokens/GPU", "weights", "grads", "optimizer", "activations", "transient", "total", "fits",
            "peak", "algo")
    cols += ("group_tokens",) if any(r["group_tokens"] for r in rows) else ()    # Attention2D's cap (memory.fit)
    print(" | ".join(f"{c:>24}" if c == "layout" else f"{c:>11}" for c in cols))
    for r in rows:
        print(" | ".join(f"{r[c]:>24}" if c == "layout" else f"{r[c]:>11.2f}" if isinstance(r[c], float)
                         else f"{str(r[c]):>11}" for c in cols))
    fits = [r for r in rows if r["fits"]]
    print("fits: " + ("; ".join(f"{r['layout']} ({r['flags']})" for r in fits) if fits else "none of these layouts"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": dataclasses.asdict(m), "params": m.params, "gpus": args.gpus,
                       "gpu_mem_gib": mem, "headroom_gib": args.headroom, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
