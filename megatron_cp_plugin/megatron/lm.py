"""The hooks our Megatron-LM patches call from `pretrain_gpt.py` / `gpt_builders.py` (patches/).

Each patch adds only calls into this module, so that what the plugin does inside Megatron-LM lives here, is
tested here, and is the same for every Megatron-LM release we patch (core_v0.16.x to core_v0.19.x):

- `add_args(parser)`: the plugin's flags, chained after Megatron's own `extra_args_provider`;
- `show_help(provider)`: `pretrain_gpt.py --help` lists the plugin's flags (Megatron's in-process-restart
  wrapper parses the command line once without the provider before `pretrain` does, and argparse's help
  action exits there);
- `resolve(args)`: `auto` / `attention2d` become a concrete algorithm once; the choice is written back into
  `args.context_parallel_algo` (and saved with checkpoints), so later calls never consult the cost model;
- `layer_spec(args)`, `install_rope(model, args, ...)`, `shard_batch(batch, args, cp_group)`: the model
  and the batch in the algorithm's layout (packed THD batches of core_v0.19 included);
- `shard_thd_batch(batch, args, cu_seqlens, cu_seqlens_padded, max_seqlen)`: core_v0.16's and 0.17's packed
  branch (core_v0.17 passes cu_seqlens squeezed to [n]; 0.18 and 0.19 keep it in the batch, as shard_batch takes).
"""
from __future__ import annotations

import sys

from .args import add_cp_args, config_from_args
from .batch import packed_seq_params
from .batch import shard_batch as _shard_batch
from .rope import install_cp_rope
from .spec import get_gpt_layer_spec

UNSUPPORTED = {
    "spec": "--spec",
    "multi_latent_attention": "--multi-latent-attention",
    "experimental_attention_variant": "--experimental-attention-variant",
    "heterogeneous_layers_config_path": "--heterogeneous-layers-config-path",
    "mtp_num_layers": "--mtp-num-layers",
    "hybrid_context_parallel": "--hybrid-context-parallel",
}
"""Megatron-LM flags whose layer specs or batch layouts would bypass the plugin's attention (args name -> flag)."""


def enabled(args) -> bool:
    """Whether `--context-parallel-algo` was given (without it Megatron-LM runs unchanged)."""
    return getattr(args, "context_parallel_algo", None) is not None


def add_args(parser, chain=None):
    """An `extra_args_provider`: `chain(parser)` first (Megatron's own provider, e.g. ModelOpt's), then ours."""
    if chain is not None:
        parser = chain(parser)
    return add_cp_args(parser)


def show_help(extra_args_provider) -> None:
    """Print Megatron-LM's help with the plugin's flags and exit, when `-h` / `--help` is on the command line."""
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        import argparse  # noqa: PLC0415

        from megatron.training.arguments import parse_args  # noqa: PLC0415 (Megatron-LM's, not megatron-core's)

        # core_v0.19.0 has a help string with a bare '%' that argparse cannot format (its --help fails with
        # "unsupported format character" without the plugin too): print such a help text unexpanded.
        expand = argparse.HelpFormatter._expand_help

        def tolerant(self, action):
            try:
                return expand(self, action)
            except (ValueError, TypeError, KeyError):
                return action.help or ""

        argparse.HelpFormatter._expand_help = tolerant
        parse_args(extra_args_provider)                       # argparse prints the help and exits 0


def check_args(args) -> None:
    """ValueError for flags the plugin cannot honour, naming them (raised on every rank at model build)."""
    bad = [flag for name, flag in UNSUPPORTED.items() if getattr(args, name, None)]
    backend = getattr(args, "attention_backend", None)
    if backend is not None and getattr(backend, "name", str(backend)) == "local":
        bad.append("--attention-backend local")               # replaces the core attention we install
    if bad:
        raise ValueError(f"--context-parallel-algo {args.context_parallel_algo} cannot be combined with "
                         f"{', '.join(bad)}: they bypass the plugin's core attention or batch layout")


def resolve(args):
    """The run's CPConfig; `auto` and `attention2d` are resolved by the cost model on the first call only."""
    check_args(args)
    cfg = config_from_args(args)
    if cfg.requested is not None:                              # remember the choice, log it once
        args.context_parallel_algo_requested = cfg.requested
        args.context_parallel_algo = cfg.algo
        if cfg.grid is not None and getattr(args, "cp_grid", None) is None:
            args.cp_grid = f"{cfg.grid[0]}x{cfg.grid[1]}"       # and the grid the cost model chose with it
    return cfg


def layer_spec(args, config=None, vp_stage=None):
    """The GPT layer spec with our core attention (Megatron's TE or local layers around it).

    `config` and `vp_stage` make it usable as megatron.training's `GPTModelConfig.transformer_layer_spec`
    callable (core_v0.19); they do not change the spec."""
    cfg = resolve(args)
    use_te = args.transformer_impl == "transformer_engine"
    return get_gpt_layer_spec(cfg.algo, grid=cfg.grid, gpus_per_node=cfg.gpus_per_node,
                              group_tokens=cfg.group_tokens,
                              num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm,
                              qk_layernorm=args.qk_layernorm,
                              normalization=None if use_te else args.normalization,   # TE: from the config
                              use_te=use_te)


def _cp_group(pg_collection=None):
    if pg_collection is not None and getattr(pg_collection, "cp", None) is not None:
        return pg_collection.cp
    from megatron.core import parallel_state  # noqa: PLC0415

    return parallel_state.get_context_parallel_group()


def install_rope(model, args, pg_collection=None):
    """RoPE positions of this rank's tokens in the algorithm's layout (Megatron's assume zigzag); returns model.
    Accepts one model or a list of pipeline stages (a core_v0.19 pre-wrap hook)."""
    algo = resolve(args).algo
    if isinstance(model, list):
        return [install_cp_rope(m, algo=algo, cp_group=_cp_group(pg_collection)) for m in model]
    return install_cp_rope(model, algo=algo, cp_group=_cp_group(pg_collection))


def configure_model_config(model_cfg, args):
    """core_v0.19: point megatron.training's GPTModelConfig at our layer spec and RoPE hook; returns it."""
    resolve(args)
    model_cfg.transformer_layer_spec = lambda config, vp_stage=None: layer_spec(args, config, vp_stage)
    model_cfg.pre_wrap_hooks = [*model_cfg.pre_wrap_hooks, lambda models: install_rope(models, args)]
    return model_cfg


def shard_batch(batch: dict, args, cp_group=None) -> dict:
    """This CP rank's tokens, labels, loss mask, position ids (and attention-mask rows) in the algorithm's
    layout, replacing Megatron's zigzag-only `get_batch_on_this_cp_rank`; other keys pass through.

    Packed (THD) batches, core_v0.19's get_batch: `cu_seqlens` [1, n] (and `cu_seqlens_padded`, by which the
    tokens are laid out when present) stay in the batch, and every document is sharded on its own in the
    algorithm's layout; each document length must be a multiple of 2 x CP (a ValueError naming cu_seqlens, the
    document and the unit otherwise: pad documents in the data loader, megatron_cp_plugin.pad_packed).
    forward_step then builds the PackedSeqParams CPCoreAttention takes."""
    if batch.get("local_cp_size") is not None:
        raise ValueError("--context-parallel-algo does not support hybrid context parallelism (local_cp_size)")
    out = _shard_batch(batch, algo=resolve(args).algo, cp_group=cp_group or _cp_group())
    out.pop("packed_seq_params", None)            # Megatron-LM builds its own from cu_seqlens
    return out


def shard_thd_batch(batch: dict, args, cu_seqlens, cu_seqlens_padded=None, max_seqlen=None, cp_group=None):
    """core_v0.16's packed get_batch branch (in place of `get_thd_batch_on_this_cp_rank`, same arguments):
    (this rank's batch, every document in the algorithm's layout; PackedSeqParams for the model). The batch
    keeps its keys and their order (get_batch returns its values)."""
    packed = dict(batch, cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded)
    out = shard_batch(packed, args, cp_group)
    cu = cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens
    params = packed_seq_params(cu, max_seqlen=None if max_seqlen is None else int(max_seqlen.max()))
    if cu_seqlens_padded is not None:             # real lengths for Megatron's accounting; layout by the padded
        params.cu_seqlens_q_padded = params.cu_seqlens_kv_padded = params.cu_seqlens_q
        params.cu_seqlens_q = params.cu_seqlens_kv = cu_seqlens.flatten()
    return {k: out[k] for k in batch}, params
