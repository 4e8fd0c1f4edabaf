"""The same TOML configs for both trainers: megatron-cp-pretrain flags -> Megatron-LM pretrain_gpt.py flags.

    python -m megatron_cp_plugin.megatron_lm.flags --world-size 64 --config configs/gpt3-13b.toml \\
        configs/algo/attention2d-no.toml --seq-length 65536 [--layout auto|zero1|fsdp] [-- more flags]

prints the pretrain_gpt.py arguments, one per line (launch/run.sh reads them with `mapfile`). The configs'
keys are Megatron-LM's flag names already, so most pass through by name; the exceptions are below. The
model is the plugin trainer's (RMSNorm, RoPE, GELU MLP with biases), so both trainers train the same thing.

Parallel layout (`--layout`): one of the memory planner's layouts (megatron_cp_plugin/bench/plan.py): ddp
(Megatron's DDP, nothing sharded), zero1 (Megatron's distributed optimizer), fsdp-optim, fsdp-optim_grads,
fsdp-optim_grads_params (Megatron-FSDP over data x context parallel; `fsdp` is the last, as the Attention2D
paper runs its linear layers, Sec. 3.3) or ppN-zero1 (N pipeline stages, CP = world / (TP x N)), each optionally
`+recompute` (full layer-wise recompute). The launch scripts pass the one the planner picked for the job's GPUs
(megatron_cp_plugin/bench/launch_plan.py). `auto` here, with no GPU size to plan for, keeps the rule of thumb:
ZeRO-1 while the bf16 weights and fp32 gradients that every GPU keeps whole under it (6 bytes per parameter) stay
under 24 GB, a third of an 80 GB GPU; above that (GPT-3 13B: 78 GB) fsdp-optim_grads_params.
"""
from __future__ import annotations

import argparse
import math
import re
import sys

from ..megatron.tokenizer import padded_vocab_size
from ..training.config import build_parser, parse_args
from .patching import NO_TE_FLAGS, have_te, release_of

DROPPED = {"config", "verbose", "result_json", "log_json", "nproc", "compare_cp1", "no_memory_check", "share_gpu",
           "offload_layer_inputs",
           "help", "tokenizer_type", "vocab_size", "dist_timeout", "data_path", "mock_data", "num_query_groups", "max_position_embeddings",
           "context_parallel_size", "global_batch_size", "ffn_hidden_size", "seq_length"}
"""Plugin-trainer flags that are not passed by name: its own (config, result_json, log_json, nproc, compare_cp1,
share_gpu, no_memory_check: the launch scripts plan in launch/prepare.sh, where PLAN_FORCE=1 overrides) or
translated below."""

ZERO1_LIMIT = 24e9
"""Bytes per GPU of bf16 weights + fp32 gradients (6 B / parameter) up to which ZeRO-1 is chosen."""


def gpt_params(a) -> float:
    """Parameters of the plugin trainer's GPT (attention with GQA, 4h or --ffn-hidden-size MLP, embeddings)."""
    h, layers = a.hidden_size, a.num_layers
    groups = a.num_query_groups or a.num_attention_heads
    kv = 2 * h * groups // a.num_attention_heads
    ffn = a.ffn_hidden_size or 4 * h
    per_layer = h * (h + kv) + h * h + 2 * h * ffn
    vocab = padded_vocab_size(a.vocab_size or 257, a.make_vocab_size_divisible_by, a.tensor_model_parallel_size)
    return layers * per_layer + vocab * h


RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
LAYOUT_RE = re.compile(r"(?:pp(\d+)-)?(ddp|zero1|fsdp|fsdp-optim|fsdp-optim_grads|fsdp-optim_grads_params)"
                       r"(\+recompute)?")


def parse_layout(a, layout: str) -> tuple[str, int, bool]:
    """(zero1 or a Megatron-FSDP strategy, pipeline stages, full recompute) of a --layout name."""
    if layout == "auto":
        layout = "zero1" if 6 * gpt_params(a) / a.tensor_model_parallel_size <= ZERO1_LIMIT else "fsdp"
    m = LAYOUT_RE.fullmatch(layout.replace(" ", ""))
    if not m or (m.group(1) and m.group(2) != "zero1") or (m.group(1) and int(m.group(1)) < 1):
        raise ValueError(f"--layout {layout}: expected auto, ddp, zero1, fsdp, fsdp-optim, fsdp-optim_grads, "
                         "fsdp-optim_grads_params or ppN-zero1, each optionally +recompute")
    zero = {"fsdp": "optim_grads_params"}.get(m.group(2), m.group(2).removeprefix("fsdp-"))
    return zero, int(m.group(1) or 1), bool(m.group(3))


FSDP_FP32_GRADS_FROM = (0, 17, 0)
"""The first Megatron-LM release with --megatron-fsdp-main-grads-dtype (default 'auto': the model's bf16, with an
fp32 copy of the gradient shard at the optimizer step; core_v0.16.1 has no such flag and keeps fp32 gradients)."""


def layout_flags(a, layout: str, release: tuple[int, int, int] | None = None) -> list[str]:
    """Megatron-LM flags of the parallel layout (see the module docstring); `release`: the Megatron-LM checkout's
    (from it on FSDP_FP32_GRADS_FROM, Megatron-FSDP layouts ask for fp32 main gradients, as the plugin trainer does
    and the memory planner counts)."""
    zero, pp, recompute = parse_layout(a, layout)
    out = [] if zero == "ddp" else ["--use-distributed-optimizer"] if zero == "zero1" else [
        "--use-megatron-fsdp", "--data-parallel-sharding-strategy", zero, "--use-distributed-optimizer",
        "--ckpt-format", "fsdp_dtensor"]
    if zero not in ("ddp", "zero1") and release is not None and release >= FSDP_FP32_GRADS_FROM:
        out += ["--megatron-fsdp-main-grads-dtype", "fp32"]
    if pp > 1:
        out += ["--pipeline-model-parallel-size", str(pp)]
    return out + (RECOMPUTE if recompute else [])


def megatron_lm_flags(a: argparse.Namespace, parser: argparse.ArgumentParser, *, world_size: int,
                      layout: str = "auto", release: tuple[int, int, int] | None = None) -> list[str]:
    """pretrain_gpt.py flags for parsed megatron-cp-pretrain args `a` (its `parser` gives the flag names) for the
    Megatron-LM `release` (None: unknown, flags every supported release takes)."""
    if getattr(a, "offload_layer_inputs", False):
        raise ValueError("--offload-layer-inputs is megatron-cp-pretrain's (training/offload.py); Megatron-LM's "
                         "activation offloading is --cpu-offloading, which needs TransformerEngine")
    out = ["--seq-length", str(a.seq_length),
           "--max-position-embeddings", str(max(a.seq_length, a.max_position_embeddings or 0)),
           "--position-embedding-type", "rope", "--normalization", "RMSNorm",
           # ByteLevel ids 0..256 (megatron-cp-preprocess) or mock data; NullTokenizer adds its EOD id on top
           "--tokenizer-type", "NullTokenizer", "--vocab-size", str(a.vocab_size or 257),
           # Megatron-LM's collectives also cover checkpoint saves: never below its default of 10 minutes
           "--distributed-timeout-minutes", str(max(10, math.ceil(a.dist_timeout / 60))),
           "--calculate-per-token-loss", "--no-create-attention-mask-in-dataloader"]
    if a.num_query_groups:
        out += ["--group-query-attention", "--num-query-groups", str(a.num_query_groups)]
    out += ["--ffn-hidden-size", str(a.ffn_hidden_size or 4 * a.hidden_size)]
    tp, pp = a.tensor_model_parallel_size, parse_layout(a, layout)[1]
    cp = a.context_parallel_size or world_size // (tp * pp)     # the plugin trainer's default: all ranks (of a stage)
    if world_size % (tp * cp * pp):
        raise ValueError(f"--context-parallel-size {cp} x --tensor-model-parallel-size {tp} x {pp} pipeline stages "
                         f"does not divide --world-size {world_size}")
    out += ["--context-parallel-size", str(cp)]
    dp = world_size // (tp * cp * pp)
    out += ["--global-batch-size", str(a.global_batch_size or a.micro_batch_size * dp)]
    if a.data_path:
        out += ["--data-path", *a.data_path, "--split", "98,2,0"]
    else:
        out += ["--mock-data"]
    layout_set = layout_flags(a, layout, release)
    for act in parser._actions:
        dest = act.dest
        if dest in DROPPED or not act.option_strings:
            continue
        val = getattr(a, dest, None)
        flag = next(o for o in act.option_strings if o.startswith("--"))
        if isinstance(act, argparse._StoreTrueAction):
            if val and flag not in layout_set:
                out.append(flag)
        elif isinstance(act, argparse._StoreFalseAction):     # --no-rope-fusion: passed by name when given
            if val is False and flag not in layout_set:
                out.append(flag)
        elif val is not None and flag not in layout_set:
            out += [flag, *(map(str, val) if isinstance(val, (list, tuple)) else [str(val)])]
    out += layout_set
    if not have_te():
        out += list(NO_TE_FLAGS)
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(prog="python -m megatron_cp_plugin.megatron_lm.flags", add_help=False)
    pre.add_argument("--world-size", type=int, required=True)
    pre.add_argument("--layout", default="auto", help="auto, zero1, fsdp[-STRATEGY], ppN-zero1, each +recompute")
    pre.add_argument("--megatron-lm", default=None, help="the Megatron-LM checkout the flags are for (its release)")
    ns, rest = pre.parse_known_args(argv)

    try:
        args = parse_args(rest)
        release = release_of(ns.megatron_lm) if ns.megatron_lm else None
        flags = megatron_lm_flags(args, build_parser(), world_size=ns.world_size, layout=ns.layout, release=release)
    except ValueError as e:
        print(f"lm_flags: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(flags))
    return 0


if __name__ == "__main__":
    sys.exit(main())
