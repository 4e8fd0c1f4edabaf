"""megatron-cp-pretrain's flags: the parser (shared with megatron-cp-generate), TOML --config files, the
TransformerConfig they describe, and the start-up checks every rank makes before its first collective."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from ..algos.registry import DEFAULT_ALGO
from ..megatron.args import add_cp_args, config_from_args
from ..megatron.tokenizer import BYTE_VOCAB_SIZE

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
"""Megatron-LM's --data-parallel-sharding-strategy values: nothing, optimizer state (ZeRO-1), + gradients
(ZeRO-2), + parameters (ZeRO-3), sharded over the data-parallel x context-parallel group."""
FSDP_DEFAULT_STRATEGY = "optim_grads_params"
NOT_IN_CONFIG_FILES = ("config", "help", "nproc", "compare-cp1")


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """Megatron's model and run flags, and the plugin's (shared with megatron-cp-generate)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--verbose", action="store_true", help="also show megatron-core's TE / Apex fallback warnings (quiet.py)")
    a("--num-layers", type=int, default=2)
    a("--hidden-size", type=int, default=64)
    a("--num-attention-heads", type=int, default=8)
    a("--num-query-groups", type=int, default=None, help="GQA groups (default: MHA)")
    a("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden")
    a("--seq-length", type=int, default=256)
    a("--max-position-embeddings", type=int, default=None)
    a("--micro-batch-size", type=int, default=1)
    a("--global-batch-size", type=int, default=None, help="default micro x data-parallel size")
    a("--lr", type=float, default=1e-3)
    a("--min-lr", type=float, default=1e-4)
    a("--lr-decay-style", choices=("constant", "linear", "cosine"), default="cosine")
    a("--lr-warmup-iters", type=int, default=0)
    a("--weight-decay", type=float, default=0.01)
    a("--clip-grad", type=float, default=1.0)
    a("--train-iters", type=int, default=20)
    a("--exit-interval", type=int, default=None, help="stop (after saving) at the first iteration divisible by N")
    a("--context-parallel-size", type=int, default=None, help="default: all ranks / TP")
    a("--tensor-model-parallel-size", type=int, default=1)
    a("--bf16", action="store_true")
    a("--use-distributed-optimizer", action="store_true",
      help="Megatron's distributed optimizer: optimizer state sharded over data-parallel x CP (ZeRO-1)")
    a("--overlap-grad-reduce", action="store_true",
      help="as Megatron-LM: Megatron's DDP and the distributed optimizer reduce (-scatter) each gradient bucket "
           "during the backward of the last micro-batch, as it fills, instead of all after it (Megatron-FSDP's "
           "optim_grads and optim_grads_params always do; with optim it stays off: megatron-core 0.16.1 trains "
           "wrong with it there)")
    a("--overlap-param-gather", action="store_true",
      help="as Megatron-LM (with --use-distributed-optimizer and --overlap-grad-reduce): the parameters the "
           "optimizer step updated are all-gathered bucket by bucket during the next forward, each bucket's "
           "gather started as the one before is used, instead of all at the end of the step; a save or an "
           "evaluation gathers them first (Megatron-FSDP's optim_grads_params always gathers per layer)")
    a("--ddp-bucket-size", type=int, default=None,
      help="as Megatron-LM: parameters per gradient bucket of Megatron's DDP with --overlap-grad-reduce (default "
           "megatron-core's: max(40M, 1M x data-parallel size))")
    a("--use-megatron-fsdp", action="store_true",
      help="Megatron-FSDP over data-parallel x CP: shards what --data-parallel-sharding-strategy names")
    a("--data-parallel-sharding-strategy", choices=SHARDING_STRATEGIES, default=None,
      help=f"with --use-megatron-fsdp (default {FSDP_DEFAULT_STRATEGY}): optim = ZeRO-1, optim_grads = ZeRO-2, "
           "optim_grads_params = ZeRO-3; no_shard is Megatron's DDP (run without --use-megatron-fsdp)")
    # Megatron-LM's recompute flags, with its meanings: --recompute-activations is the selective kind (core
    # attention only); layer-wise ("full") checkpointing, what Attention2D's 13B runs needed, is
    # --recompute-granularity full --recompute-method uniform --recompute-num-layers 1.
    a("--recompute-activations", action="store_true", help="selective recompute (= --recompute-granularity "
      "selective), as in Megatron-LM")
    a("--recompute-granularity", choices=("full", "selective"), default=None)
    a("--recompute-method", choices=("uniform", "block"), default=None, help="for full recompute (default uniform)")
    a("--recompute-num-layers", type=int, default=None, help="for full recompute (default 1)")
    a("--offload-layer-inputs", action="store_true", help="with --recompute-granularity full: keep each layer's "
      "checkpointed input in pinned host memory until the backward (training/offload.py; megatron-cp-pretrain "
      "only)")
    a("--attention-dropout", type=float, default=0.0)
    a("--hidden-dropout", type=float, default=0.0)
    a("--no-rope-fusion", dest="apply_rope_fusion", action="store_false", help="as Megatron-LM: megatron-core's "
      "unfused RoPE (about ten elementwise kernels per tensor each way). By default GPU runs of unpacked batches "
      "apply RoPE in one kernel each way: TransformerEngine's where installed, else kernels/rope.py")
    a("--save", default=None)
    a("--load", default=None)
    a("--save-interval", type=int, default=None)
    a("--overwrite", action="store_true", help="let --save replace the checkpoint already in its directory "
      "(without it, and without --load of that directory, such a run is refused)")
    a("--data-path", nargs="+", default=None, help="prefixes of .bin/.idx files (megatron-cp-preprocess)")
    a("--mock-data", action="store_true", help="random tokens (the default without --data-path)")
    # Megatron-LM's names for training on packed documents; here both are one switch (docs/packed.md).
    a("--reset-attention-mask", action="store_true", help="EOD tokens end documents: attention stays inside each "
      "document (packed THD batches); needs --reset-position-ids")
    a("--reset-position-ids", action="store_true", help="positions restart in every document; needs "
      "--reset-attention-mask")
    a("--document-unit", type=int, default=None, help="with --reset-attention-mask: pad every document to a "
      "multiple of N tokens (default 2 x CP, 1 at CP 1; a multiple of that); the same N at every CP size "
      "gives the same batches, e.g. for comparing with CP = 1")
    a("--tokenizer-type", default="ByteLevel", choices=("ByteLevel",))
    a("--vocab-size", type=int, default=None, help="default: the tokenizer's (257 for ByteLevel)")
    a("--make-vocab-size-divisible-by", type=int, default=128, help="as Megatron-LM: the embedding and output "
      "layer get the vocabulary rounded up to a multiple of N x TP rows (257 -> 384 by default)")
    a("--log-interval", type=int, default=1)
    a("--eval-interval", type=int, default=None)
    a("--eval-iters", type=int, default=2)
    a("--seed", type=int, default=1234)
    a("--deterministic-mode", action="store_true", help="as Megatron-LM: bit-identical reruns on the same "
      "machine and layout (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG=:4096:8, the attention "
      "kernels' deterministic backward; costs step time: docs/training.md)")
    a("--dist-timeout", type=float, default=60.0, help="seconds a collective waits for a peer before failing")
    a("--nproc", type=int, default=None, help="spawn this many local processes (instead of torchrun)")
    a("--share-gpu", action="store_true", help="let more ranks than GPUs run on this machine, sharing them over "
      "gloo with CUDA tensors (to verify on one GPU what runs on many; timings are not representative). Under "
      "torchrun / SLURM: MCP_SHARE_GPU=1")
    a("--no-memory-check", action="store_true", help="start a run that the memory planner says will not fit its "
      "GPUs (checked before any rank starts: the planned peak + 4 GiB against the capacity the GPU reports; "
      "training/memory_check.py)")
    a("--log-json", default=None, help="append one JSON line per logged iteration to this file")
    a("--compare-cp1", action="store_true", help="first train the same model with CP = 1 (one process), then "
      "this run, and print both loss curves side by side")
    add_cp_args(p, default=DEFAULT_ALGO)
    return p


def add_run_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--config and --result-json: what megatron-cp-pretrain adds to build_parser's flags."""
    p.add_argument("--config", nargs="+", default=None, metavar="FILE",
                   help="TOML files of flag defaults (keys = flag names without --); later files override earlier "
                        "ones, flags on the command line override the files")
    p.add_argument("--result-json", default=None, metavar="PATH",
                   help="rank 0 writes the run's settings, per-iteration losses and step times, median step time, "
                        "tokens/s and exit status here (also when the run fails)")
    return p


def parse_args(argv=None, description: str | None = None) -> argparse.Namespace:
    """megatron-cp-pretrain's flags: build_parser's, --config and --result-json."""
    return parse_with_configs(add_run_args(build_parser(description)), argv)


CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
"""The shipped configs (GPT-3 sizes, algo/, tiny, recompute-full): `--config gpt3-13b` finds them anywhere."""


def resolve_config(name: str) -> str:
    """A config file path: `name` itself when it exists, else the shipped config of that name (`gpt3-13b`,
    `gpt3-13b.toml`, `algo/ring`, `configs/algo/ring.toml`); otherwise `name` (the open error names it)."""
    if Path(name).is_file():
        return name
    stem = name[len("configs/"):] if name.startswith("configs/") else name
    shipped = CONFIG_DIR / (stem if stem.endswith(".toml") else stem + ".toml")
    return str(shipped) if shipped.is_file() else name


def shipped_configs() -> list[str]:
    """Names of the shipped configs, for error messages and --help."""
    return sorted(str(p.relative_to(CONFIG_DIR).with_suffix("")) for p in CONFIG_DIR.rglob("*.toml"))


def load_config_files(parser: argparse.ArgumentParser, files) -> dict:
    """Merge TOML config files (later ones win) into {dest: value}, checked against the parser's flags.

    Keys are flag names without the dashes (`num-layers = 24`, `bf16 = true`); values are converted with the
    flag's type and checked against its choices, so a bad file fails here, naming the key and the file."""
    try:
        import tomllib
    except ImportError:                                # Python 3.10: the same parser as a package
        try:
            import tomli as tomllib
        except ImportError:
            parser.error("--config needs Python >= 3.11 (tomllib) or the tomli package")

    flags = {opt[2:]: act for act in parser._actions for opt in act.option_strings if opt.startswith("--")}
    merged = {}
    for path in files:
        path = resolve_config(path)
        try:
            with open(path, "rb") as f:
                table = tomllib.load(f)
        except OSError as e:
            parser.error(f"--config {path}: {e.strerror} (shipped configs: {', '.join(shipped_configs())})")
        except tomllib.TOMLDecodeError as e:
            parser.error(f"--config {path}: not valid TOML: {e}")
        for key, value in table.items():
            if isinstance(value, dict):
                parser.error(f"--config {path}: [{key}]: tables are not supported, keys are flat flag names")
            act = flags.get(key)
            if act is None or key in NOT_IN_CONFIG_FILES:
                hint = f" (flag names use dashes: {key.replace('_', '-')!r})" if "_" in key else ""
                parser.error(f"--config {path}: unknown key {key!r}: not a megatron-cp-pretrain flag that a config "
                             f"file can set{hint}")
            merged[act.dest] = _config_value(parser, path, key, act, value)
    return merged


def _config_value(parser, path, key, act, value):
    """One config value as the flag would have parsed it from the command line."""
    where = f"--config {path}: {key} = {value!r}"
    if act.nargs == 0:                                       # store_true / store_false flags
        if not isinstance(value, bool):
            parser.error(f"{where}: must be true or false")
        return value
    if isinstance(value, bool):
        parser.error(f"{where}: this flag takes a value, not true/false")
    if act.nargs in ("+", "*"):
        items = value if isinstance(value, list) else [value]
    elif isinstance(value, list):
        parser.error(f"{where}: this flag takes one value, not a list")
    else:
        items = [value]
    out = []
    for item in items:
        try:
            item = act.type(str(item)) if act.type is not None else str(item)
        except (TypeError, ValueError):
            parser.error(f"{where}: not a valid {getattr(act.type, '__name__', 'value')}")
        if act.choices is not None and item not in act.choices:
            parser.error(f"{where}: must be one of {', '.join(map(str, act.choices))}")
        out.append(item)
    return out if act.nargs in ("+", "*") else out[0]


def parse_with_configs(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parse argv where --config files supply the defaults: file < later file < command line."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", nargs="+", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config:
        parser.set_defaults(**load_config_files(parser, known.config))
    return parser.parse_args(argv)


def launch_errors(args) -> list[str]:
    """Flag errors found in the launching process, before any rank starts: one line each, naming the flag and
    what was expected (the checks that need the world size run on every rank, in validate_args)."""
    errors = []
    if args.nproc is not None and args.nproc < 1:
        errors.append(f"--nproc {args.nproc}: must be at least 1 (local processes to spawn)")
    # (--eval-interval / --save-interval / --exit-interval 0 keep meaning "never", as their `if` reads them)
    for flag in ("log_interval", "micro_batch_size", "train_iters", "seq_length", "global_batch_size",
                 "make_vocab_size_divisible_by", "ddp_bucket_size"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            errors.append(f"--{flag.replace('_', '-')} {value}: must be at least 1")
    if args.vocab_size is not None and args.vocab_size < BYTE_VOCAB_SIZE:     # the byte tokenizer's ids
        errors.append(f"--vocab-size {args.vocab_size}: must be at least {BYTE_VOCAB_SIZE} (256 bytes and the "
                      "end-of-document token)")
    if getattr(args, "overlap_param_gather", False):          # Megatron-LM's own conditions for the flag
        if not (args.use_distributed_optimizer or args.use_megatron_fsdp):
            errors.append("--overlap-param-gather: needs --use-distributed-optimizer (or --use-megatron-fsdp): "
                          "only sharded parameters are gathered")
        elif args.use_distributed_optimizer and not args.use_megatron_fsdp and not args.overlap_grad_reduce:
            errors.append("--overlap-param-gather: needs --overlap-grad-reduce too (as in Megatron-LM)")
    if args.data_path and args.mock_data:
        errors.append("--mock-data and --data-path exclude each other: give one (random tokens, or the "
                      ".bin/.idx files)")
    for prefix in args.data_path or ():
        missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if missing:
            errors.append(f"--data-path {prefix}: {' and '.join(missing)} not found (a prefix of "
                          "megatron-cp-preprocess's output)")
    return errors


def transformer_config(args, gpu: bool):
    """The TransformerConfig of the flags (RMSNorm, RoPE model; per-token loss for exact CP reduction)."""
    from megatron.core.transformer import TransformerConfig

    rope_fusion = rope_fusion_on(args, gpu)
    if rope_fusion:
        from ..megatron.compat import install_fused_rope
        install_fused_rope()

    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        context_parallel_size=args.context_parallel_size, normalization="RMSNorm", bf16=args.bf16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32, use_cpu_initialization=not gpu,
        calculate_per_token_loss=True, deterministic_mode=getattr(args, "deterministic_mode", False),
        apply_rope_fusion=rope_fusion, **recompute_kwargs(args))


def rope_fusion_on(args, gpu: bool) -> bool:
    """Whether RoPE runs fused: on GPUs unless --no-rope-fusion; not for packed documents (megatron-core's fused
    THD path is TE's alone, and its rows follow TE's zigzag: megatron/rope.py). On CPUs the unfused path keeps
    the fp32 tests on megatron-core's own code."""
    return gpu and getattr(args, "apply_rope_fusion", True) and not getattr(args, "reset_attention_mask", False)


def recompute_kwargs(args) -> dict:
    """TransformerConfig's recompute fields from Megatron-LM's flags (same defaults and precedence)."""
    granularity = getattr(args, "recompute_granularity", None)
    if getattr(args, "recompute_activations", False):
        granularity = "selective"                     # Megatron-LM: --recompute-activations wins
    if granularity is None:
        return {}
    if granularity == "selective":
        return {"recompute_granularity": "selective"}
    return {"recompute_granularity": "full", "recompute_method": getattr(args, "recompute_method", None) or "uniform",
            "recompute_num_layers": getattr(args, "recompute_num_layers", None) or 1}


def sharding_strategy(args) -> str | None:
    """The Megatron-FSDP strategy of a run, None without --use-megatron-fsdp."""
    if not getattr(args, "use_megatron_fsdp", False):
        return None
    return getattr(args, "data_parallel_sharding_strategy", None) or FSDP_DEFAULT_STRATEGY


def validate_args(args, world: int, log: bool = True):
    """Start-up checks, identical on every rank and before any collective; fills in the derived sizes
    (context_parallel_size, data_parallel_size, global_batch_size) and returns the plugin's CPConfig.
    log: rank 0 prints the cost model's choice (`auto`, `attention2d`) when it made one."""
    tp = args.tensor_model_parallel_size
    if world % tp:
        raise ValueError(f"--tensor-model-parallel-size {tp} does not divide the {world} ranks")
    if args.context_parallel_size is None:
        args.context_parallel_size = world // tp
    cp = args.context_parallel_size
    if world % (tp * cp):
        raise ValueError(f"--context-parallel-size {cp} x --tensor-model-parallel-size {tp} does not divide the "
                         f"{world} ranks")
    args.data_parallel_size = world // (tp * cp)
    args.global_batch_size = args.global_batch_size or args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % (args.micro_batch_size * args.data_parallel_size):
        raise ValueError(f"--global-batch-size {args.global_batch_size} must be a multiple of --micro-batch-size x "
                         f"data-parallel size = {args.micro_batch_size * args.data_parallel_size}")
    if args.num_attention_heads % (args.num_query_groups or args.num_attention_heads):
        raise ValueError("--num-attention-heads must be divisible by --num-query-groups")
    if args.max_position_embeddings is not None and args.max_position_embeddings < args.seq_length:
        raise ValueError("--max-position-embeddings must be at least --seq-length")
    strategy = getattr(args, "data_parallel_sharding_strategy", None)
    if strategy is not None and not getattr(args, "use_megatron_fsdp", False):
        raise ValueError(f"--data-parallel-sharding-strategy {strategy} needs --use-megatron-fsdp (without it: "
                         "Megatron's DDP, plus --use-distributed-optimizer for ZeRO-1)")
    if sharding_strategy(args) == "no_shard":
        # megatron-core 0.16.1: Megatron-FSDP's no_shard crashes in the distributed optimizer's step (it
        # gathers parameters from a buffer no_shard never made), and without that optimizer its gradients
        # are not summed over the group. Replicating everything is what Megatron's DDP does.
        raise ValueError("--data-parallel-sharding-strategy no_shard does not train in megatron-core 0.16.1's "
                         "Megatron-FSDP; for no sharding drop --use-megatron-fsdp (Megatron's DDP)")
    if getattr(args, "offload_layer_inputs", False) and recompute_kwargs(args).get("recompute_granularity") != "full":
        raise ValueError("--offload-layer-inputs needs --recompute-granularity full (it moves the checkpointed layer "
                         "inputs; without full recompute every activation would cross PCIe)")
    cp_cfg = config_from_args(args, log=log)       # --context-parallel-algo, --cp-grid, sequence divisibility
    document_unit(args, cp_cfg.algo)
    return cp_cfg


def document_unit(args, algo: str) -> int | None:
    """The multiple every packed document is padded to (None without --reset-attention-mask); ValueError naming
    the flag when the packing flags do not fit together."""
    from ..megatron.batch import packed_unit

    mask, pos = getattr(args, "reset_attention_mask", False), getattr(args, "reset_position_ids", False)
    unit = getattr(args, "document_unit", None)
    if mask != pos:
        given, missing = ("--reset-attention-mask", "--reset-position-ids") if mask else \
            ("--reset-position-ids", "--reset-attention-mask")
        raise ValueError(f"{given} needs {missing} too (documents are packed with both, or neither)")
    if not mask:
        if unit is not None:
            raise ValueError("--document-unit needs --reset-attention-mask --reset-position-ids")
        return None
    need = packed_unit(algo, args.context_parallel_size)
    if unit is None:
        unit = need
    elif unit < 1 or unit % need:
        raise ValueError(f"--document-unit {unit} must be a positive multiple of {need} (2 x CP for packed "
                         f"documents at CP {args.context_parallel_size})")
    if args.seq_length % unit:
        raise ValueError(f"--seq-length {args.seq_length} must be a multiple of the document unit {unit} with "
                         "--reset-attention-mask (packed rows keep their length)")
    return unit
