"""`megatron-cp-bench SUBCOMMAND [flags]`: every benchmark behind one command (`--help` on each).

    torchrun --nproc-per-node 2 -m megatron_cp_plugin.bench attention --seq 131072 [--slow-link]
    torchrun --nproc-per-node 2 -m megatron_cp_plugin.bench packed --tokens 131072 --mean-doc 4096
    torchrun --nproc-per-node 2 -m megatron_cp_plugin.bench decode --context 32768 131072 524288
    torchrun --nproc-per-node 2 -m megatron_cp_plugin.bench model --config configs/gpt3-760m.toml --seq-length 65536
    python -m megatron_cp_plugin.bench deft | flash-decode | local-attn | rank | cost-model --table ...
    python -m megatron_cp_plugin.bench plan --config configs/gpt3-175b.toml --gpus 64 --gpu-mem 80
    python -m megatron_cp_plugin.bench plot [--kind attention|rank] results/attention.json

Subcommands that need several GPUs run under torchrun (more ranks than GPUs: --share-gpu, verification only); each writes JSON (with the command and device), a
markdown table and, where matplotlib is installed, a PNG next to --out.
"""
from __future__ import annotations

import importlib
import json
import sys

SUBCOMMANDS = {
    "attention": ("megatron_cp_plugin.bench.cp_attention", "CP attention algorithms, single GPU and anchors"),
    "packed": ("megatron_cp_plugin.bench.packed", "packed documents: every algorithm vs single-GPU varlen"),
    "decode": ("megatron_cp_plugin.bench.decode", "tree decoding variants vs ring decoding vs one GPU"),
    "layer": ("megatron_cp_plugin.bench.model", "one Megatron transformer layer per algorithm"),
    "model": ("megatron_cp_plugin.bench.model", "a whole GPT config per algorithm: tokens/s, TFLOP/s, MFU"),
    "deft": ("megatron_cp_plugin.bench.deft", "DeFT tree-attention workloads against the baselines"),
    "flash-decode": ("megatron_cp_plugin.bench.flash_decode", "the split-KV decode kernel vs prefill kernels"),
    "local-attn": ("megatron_cp_plugin.bench.local_attn", "local attention kernels (cuDNN, FA2, math)"),
    "merge": ("megatron_cp_plugin.bench.merge", "the fused (o, lse) merge and fp32 accumulation vs PyTorch's ops"),
    "norm": ("megatron_cp_plugin.bench.norm", "the decode step's fused RMSNorm / LayerNorm vs torch's modules"),
    "rope": ("megatron_cp_plugin.bench.rope", "training RoPE in one kernel each way vs megatron-core's unfused"),
    "bias-add": ("megatron_cp_plugin.bench.bias_add", "the decode step's fused bias + residual add vs torch's two"),
    "gemv": ("megatron_cp_plugin.bench.gemv", "the decode step's fused linear (bias, GELU) vs cuBLAS + torch's ops"),
    "peer-merge": ("megatron_cp_plugin.bench.peer_merge", "tree decoding's NVLink exchange + merge vs NCCL + merge"),
    "peer-sum": ("megatron_cp_plugin.bench.peer_sum", "the split MLPs' NVLink reduce vs NCCL all-reduce + adds"),
    "surrogate": ("megatron_cp_plugin.bench.surrogate", "the fused surrogate-O kernel vs its PyTorch reference"),
    "rank": ("megatron_cp_plugin.bench.rank_cli", "one rank's local work per algorithm on one device, vs ideal"),
    "cost-model": ("megatron_cp_plugin.bench.cost_report", "the cost model's tables (--table), one problem (--seq)"),
    "plan": ("megatron_cp_plugin.bench.plan", "per-GPU memory of a config under ZeRO-1/2/3, pipeline stages, recompute"),
    "plot": (None, "draw the PNG of a result JSON again (bench/plots.py; --kind attention|rank for older JSONs)"),
}


def _usage() -> str:
    return __doc__ + "\nsubcommands:\n" + "\n".join(f"  {k:13s} {v[1]}" for k, v in SUBCOMMANDS.items())


def main(argv=None):
    argv = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--verbose"]   # quiet.py read it
    if "--share-gpu" in argv:              # every subcommand: ranks share the GPUs (devices.py); also for children
        from ..devices import enable_sharing
        enable_sharing()
        argv.remove("--share-gpu")
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in SUBCOMMANDS:
        raise SystemExit(f"megatron-cp-bench: unknown subcommand {cmd!r}; expected one of {', '.join(SUBCOMMANDS)}")
    if cmd == "plot":
        from .plots import draw
        kind = None                        # --kind attention|rank: that figure for a JSON that names none or lines
        if rest[:1] == ["--kind"] and len(rest) > 1:
            kind, rest = rest[1], rest[2:]
        for path in rest:
            with open(path) as f:
                res = json.load(f)
            spec = {"kind": kind} if kind else res.get("plot")
            if not spec:
                raise SystemExit(f"{path} names no figure (its \"plot\" entry); --kind attention or rank draws one")
            draw(res["rows"], path[:-len(".json")] + ".png", spec, header=res.get("header", ""),
                 device=res.get("device"))
        return 0
    module = importlib.import_module(SUBCOMMANDS[cmd][0])
    if cmd == "layer":
        rest = ["--num-layers", "1", *rest]
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())
