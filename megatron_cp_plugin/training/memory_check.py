"""megatron-cp-pretrain's memory check and allocator default, before any rank starts (issue 35 item 2).

The memory planner (cost/memory.py) sizes the run the flags describe: its per-GPU peak plus HEADROOM_GIB against
the capacity the GPU reports (devices.gpu_capacity_gib: the driver's total less what it reserves, read without
creating a CUDA context in the launching process). A run that does not fit ends in one line naming the layouts
that do fit (their flags) before any process starts; --no-memory-check starts it anyway (the planner is an
estimate). Ranks sharing one GPU (--share-gpu) add up. Without a GPU (CPU ranks) there is nothing to check.

Fragmentation: with torch's default allocator, GPT-3 2.7B at 64k on 2 x H200 ran out of memory with 7.5 GiB
reserved but unallocated (ring, allgather), and fit with expandable segments (131 GB peak, 2026-11-25). So the
ranks get PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless the user set PYTORCH_CUDA_ALLOC_CONF
(any value, "" included, is kept: that is how to opt out).
"""
from __future__ import annotations

import os

from .. import devices
from ..cost import memory

HEADROOM_GIB = memory.HEADROOM_GIB
"""GiB per GPU kept free beyond the planner's peak (the planner's own default)."""
ALLOC_CONF = "expandable_segments:True"
"""The allocator setting the ranks get by default (see the module docstring)."""
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
"""configs/recompute-full.toml: Megatron-LM's full layer-wise recompute, one layer per checkpoint."""


def model_from_args(args) -> memory.Model:
    """The planner's model of the parsed megatron-cp-pretrain flags (ValueError with TP > 1: not modelled)."""
    if getattr(args, "tensor_model_parallel_size", 1) != 1:
        raise ValueError("--tensor-model-parallel-size: the planner models TP = 1 only")
    from ..algos import registry
    from ..megatron.args import parse_grid
    from ..megatron.tokenizer import ByteTokenizer, padded_vocab_size
    from .config import rope_fusion_on             # plans are for GPU runs
    vocab = padded_vocab_size(args.vocab_size or ByteTokenizer(None).vocab_size,
                              getattr(args, "make_vocab_size_divisible_by", 128))
    return memory.Model(layers=args.num_layers, hidden=args.hidden_size, heads=args.num_attention_heads,
                 groups=args.num_query_groups or args.num_attention_heads,
                 ffn=args.ffn_hidden_size or 4 * args.hidden_size, vocab=vocab, seq=args.seq_length,
                 micro_batch=args.micro_batch_size, bf16=args.bf16,
                 algo=getattr(args, "context_parallel_algo", None) or registry.DEFAULT_ALGO,
                 grid=parse_grid(getattr(args, "cp_grid", None)), group_tokens=getattr(args, "cp_group_tokens", None),
                 rope_fused=rope_fusion_on(args, gpu=True))


def config_layout(a) -> memory.Layout:
    """The layout the parsed megatron-cp-pretrain flags describe."""
    from .config import recompute_kwargs, sharding_strategy
    strategy = sharding_strategy(a)
    zero = f"fsdp-{strategy}" if strategy else "zero1" if a.use_distributed_optimizer else "ddp"
    full = recompute_kwargs(a).get("recompute_granularity") == "full"
    return memory.Layout(zero, 1, full, full and bool(getattr(a, "offload_layer_inputs", False)))


def layout_args(layout: memory.Layout, est: memory.Estimate | None = None) -> list[str]:
    """megatron-cp-pretrain flags that select `layout` on top of the configs' (appended: they win), and the group
    cap of `est` (memory.fit's) where it is below the default."""
    out = {"ddp": [], "zero1": ["--use-distributed-optimizer"]}.get(layout.zero)
    if out is None:
        out = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", layout.zero.split("-", 1)[1]]
    out += (RECOMPUTE if layout.recompute else []) + (["--offload-layer-inputs"] if layout.offload else [])
    return out + memory.group_flag(est.group_tokens if est is not None else None).split()


def candidates(a, m: memory.Model, gpus: int, trainer: str) -> list[memory.Layout]:
    """Layouts auto may pick, in memory.recommend's order, consistent with what the flags already force."""
    forced = config_layout(a)
    order = [memory.Layout(z, 1, rc) for rc in (False, True) for z in memory.PREFERENCE]
    if trainer == "plugin":                        # --offload-layer-inputs is megatron-cp-pretrain's
        order += [memory.Layout(z, 1, True, True) for z in memory.PREFERENCE]
    if trainer == "megatron-lm" and a.context_parallel_size is None:
        order += [lay for lay in memory.layouts(m, gpus) if lay.pp > 1]
    if forced.recompute:
        order = [lay for lay in order if lay.recompute]
    if forced.offload:
        order = [lay for lay in order if lay.offload]
    if a.use_megatron_fsdp:
        order = [lay for lay in order if lay.zero == forced.zero]
    return order


def allocator_env(environ=None) -> dict:
    """The environment with the allocator default applied (a user's PYTORCH_CUDA_ALLOC_CONF wins)."""
    env = os.environ if environ is None else environ
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)
    return env


def refusal(args, world: int, capacity_gib: float | None = None) -> str | None:
    """One line when the run `args` describes on `world` ranks will not fit its GPUs; None when it fits, when the
    check is off or cannot be made (no GPU, TP > 1, which the planner does not model). When it fits only with
    Attention2D's smaller grouped calls and the flags leave the cap open (no --cp-group-tokens), sets
    args.cp_group_tokens to that cap (memory.fit), which the ranks then run with."""
    if getattr(args, "no_memory_check", False):
        return None
    gpus = devices.gpu_count()
    if not gpus:
        return None
    capacity = devices.gpu_capacity_gib() if capacity_gib is None else capacity_gib
    if capacity is None:
        return None
    try:
        m = model_from_args(args)
    except ValueError:                             # TP > 1: the planner cannot say
        return None
    cp = args.context_parallel_size or world
    share = -(-world // gpus) if devices.shares_gpu(devices.sharing(getattr(args, "share_gpu", False)), world) else 1
    mine = config_layout(args)

    fitted: dict = {}

    def est(lay) -> memory.Estimate:                 # each layout fitted once (the message reads it again)
        if lay not in fitted:
            fitted[lay] = memory.fit(m, lay, cp, capacity / share, HEADROOM_GIB)
        return fitted[lay]

    def need(lay) -> float:
        return share * est(lay).total / memory.GiB

    gib = need(mine)
    if gib + share * HEADROOM_GIB <= capacity:
        if m.group_tokens is None and est(mine).group_tokens is not None:     # the default rule did not fit
            args.cp_group_tokens = est(mine).group_tokens
        return None
    fits = [lay for lay in candidates(args, m, cp, "plugin") if lay != mine
            and need(lay) + share * HEADROOM_GIB <= capacity]
    ranks = f", {share} ranks per GPU" if share > 1 else ""
    alt = "; ".join(f"{lay.name} ({need(lay):.1f} GiB: {' '.join(layout_args(lay, est(lay)))})" for lay in fits[:3])
    alt = f"; these fit: {alt}" if fits else "; no layout fits: use more GPUs or a shorter --seq-length"
    return (f"the memory plan ({mine.name}, CP = {cp}{ranks}) needs {gib:.1f} GiB + {share * HEADROOM_GIB:g} GiB "
            f"headroom per GPU of {capacity:.1f} GiB{alt}; --no-memory-check starts it anyway")
