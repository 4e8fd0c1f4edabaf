"""GPT pretraining with context-parallel attention: `megatron-cp-pretrain` / `python -m megatron_cp_plugin.pretrain`.

    torchrun --nproc-per-node 4 -m megatron_cp_plugin.pretrain --context-parallel-size 4 \\
        --context-parallel-algo attention2d --mock-data --train-iters 20
    megatron-cp-pretrain --nproc 4 ...        # same, spawning the processes itself (no torchrun)
    megatron-cp-pretrain --config configs/gpt3-2.7b.toml configs/algo/ring.toml --seq-length 65536 ...

--config reads TOML files whose keys are these flags' names (`num-layers = 24`, `bf16 = true`); later files
override earlier ones and the command line overrides them all. --result-json writes one JSON per run.

Megatron's flag names. On GPUs: bf16 with --bf16, Megatron DDP over the data-parallel-with-CP group and the
Megatron optimizer (ZeRO with --use-distributed-optimizer). Without a GPU: gloo, fp32, torch AdamW, and the
gradients summed over the same group by hand (Megatron's DDP and optimizer hard-code CUDA). The loss is the
global token mean: every CP rank sums its tokens' losses and divides by the loss tokens of all ranks, and
gradients are summed, not averaged, over data-parallel x CP (`calculate_per_token_loss` on GPUs).
A failing rank prints its error and exits non-zero; its peers' next collective fails (or times out after
--dist-timeout seconds) and they exit too, so a job never hangs silently.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from .megatron.args import add_cp_args, config_from_args


def build_parser(description: str = __doc__) -> argparse.ArgumentParser:
    """Megatron's model and run flags, and the plugin's (shared with megatron-cp-generate)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
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
    a("--use-distributed-optimizer", action="store_true")
    # Megatron-LM's recompute flags, with its meanings: --recompute-activations is the selective kind (core
    # attention only); layer-wise ("full") checkpointing, what Attention2D's 13B runs needed, is
    # --recompute-granularity full --recompute-method uniform --recompute-num-layers 1.
    a("--recompute-activations", action="store_true", help="selective recompute (= --recompute-granularity "
      "selective), as in Megatron-LM")
    a("--recompute-granularity", choices=("full", "selective"), default=None)
    a("--recompute-method", choices=("uniform", "block"), default=None, help="for full recompute (default uniform)")
    a("--recompute-num-layers", type=int, default=None, help="for full recompute (default 1)")
    a("--attention-dropout", type=float, default=0.0)
    a("--hidden-dropout", type=float, default=0.0)
    a("--save", default=None)
    a("--load", default=None)
    a("--save-interval", type=int, default=None)
    a("--data-path", nargs="+", default=None, help="prefixes of .bin/.idx files (megatron-cp-preprocess)")
    a("--mock-data", action="store_true", help="random tokens (the default without --data-path)")
    a("--tokenizer-type", default="ByteLevel", choices=("ByteLevel",))
    a("--vocab-size", type=int, default=None, help="default: the tokenizer's (257 for ByteLevel)")
    a("--log-interval", type=int, default=1)
    a("--eval-interval", type=int, default=None)
    a("--eval-iters", type=int, default=2)
    a("--seed", type=int, default=1234)
    a("--dist-timeout", type=float, default=60.0, help="seconds a collective waits for a peer before failing")
    a("--nproc", type=int, default=None, help="spawn this many local processes (instead of torchrun)")
    a("--log-json", default=None, help="append one JSON line per logged iteration to this file")
    a("--compare-cp1", action="store_true", help="first train the same model with CP = 1 (one process), then "
      "this run, and print both loss curves side by side")
    add_cp_args(p)
    p.set_defaults(context_parallel_algo="attention2d")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """megatron-cp-pretrain's flags: build_parser's, --config and --result-json."""
    p = build_parser()
    p.add_argument("--config", nargs="+", default=None, metavar="FILE",
                   help="TOML files of flag defaults (keys = flag names without --); later files override earlier "
                        "ones, flags on the command line override the files")
    p.add_argument("--result-json", default=None, metavar="PATH",
                   help="rank 0 writes the run's settings, per-iteration losses and step times, median step time, "
                        "tokens/s and exit status here (also when the run fails)")
    return parse_with_configs(p, argv)


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
        try:
            with open(path, "rb") as f:
                table = tomllib.load(f)
        except OSError as e:
            parser.error(f"--config {path}: {e.strerror}")
        except tomllib.TOMLDecodeError as e:
            parser.error(f"--config {path}: not valid TOML: {e}")
        for key, value in table.items():
            if isinstance(value, dict):
                parser.error(f"--config {path}: [{key}]: tables are not supported, keys are flat flag names")
            act = flags.get(key)
            if act is None or key in ("config", "help", "nproc", "compare-cp1"):
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


def transformer_config(args, gpu: bool):
    """The TransformerConfig of the flags (RMSNorm, RoPE model; per-token loss for exact CP reduction)."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        context_parallel_size=args.context_parallel_size, normalization="RMSNorm", bf16=args.bf16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32, use_cpu_initialization=not gpu,
        calculate_per_token_loss=True, **_recompute_kwargs(args))


def _recompute_kwargs(args) -> dict:
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


def _validate(args, world: int):
    """Start-up checks, identical on every rank and before any collective."""
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
    if args.bf16 and not torch.cuda.is_available():
        raise ValueError("--bf16 needs GPUs (the CPU path trains in fp32)")
    return config_from_args(args)                  # --context-parallel-algo, --cp-grid, sequence divisibility


# ------------------------------------------------------------------------------------------------ data
def _datasets(args, tokenizer):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    mock = args.data_path is None
    cfg = GPTDatasetConfig(random_seed=args.seed, sequence_length=args.seq_length,
                           blend=None if mock else (args.data_path, None), split="98,2,0", tokenizer=tokenizer,
                           reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                           create_attention_mask=False,      # causal is implicit; an [S, S] mask per sample is not
                           path_to_cache=os.path.join(args.save or ".", ".index_cache") if not mock else None)
    evals = (args.train_iters // args.eval_interval + 1) * args.eval_iters if args.eval_interval else 0
    sizes = [args.train_iters * args.global_batch_size, evals * args.global_batch_size or None, None]
    train, valid, _ = BlendedMegatronDatasetBuilder(MockGPTDataset if mock else GPTDataset, sizes, lambda: True,
                                                    cfg).build()
    return train, valid


def _micro_batches(dataset, args, it: int, dp_rank: int):
    """The micro-batches of iteration `it` for this data-parallel rank: sample indices are a function of the
    iteration, so a resumed run reads exactly what the uninterrupted one would have."""
    per_iter, mb = args.global_batch_size, args.micro_batch_size
    for m in range(per_iter // (mb * args.data_parallel_size)):
        first = it * per_iter + (m * args.data_parallel_size + dp_rank) * mb
        samples = [dataset[(first + j) % len(dataset)] for j in range(mb)]
        yield {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in
               ("tokens", "labels", "loss_mask", "position_ids")}


# ------------------------------------------------------------------------------------------------ training
def _flops_per_iter(args, n_params: int) -> float:
    """6 x params x tokens (matmuls, fwd + bwd) + 6 x layers x seq x hidden x tokens (causal attention)."""
    tokens = args.global_batch_size * args.seq_length
    return 6.0 * n_params * tokens + 6.0 * args.num_layers * args.seq_length * args.hidden_size * tokens


class Trainer:
    def __init__(self, args, cp_cfg, device):
        from megatron.core import parallel_state as ps
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        from .megatron.model import build_gpt
        from .megatron.tokenizer import ByteTokenizer

        self.args, self.cp_cfg, self.device, self.ps = args, cp_cfg, device, ps
        self.gpu = device.type == "cuda"
        self.tokenizer = ByteTokenizer(args.vocab_size)
        self.cp_group = ps.get_context_parallel_group()
        self.dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)
        self.dp_rank = ps.get_data_parallel_rank()
        config = transformer_config(args, self.gpu)
        torch.manual_seed(args.seed)
        if self.gpu:                                   # Megatron initialises GPU weights from its RNG tracker
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
            model_parallel_cuda_manual_seed(args.seed)
        model = build_gpt(config, cp_cfg, vocab_size=self.tokenizer.vocab_size,
                          seq_length=args.max_position_embeddings or args.seq_length, cp_group=self.cp_group)
        self.n_params = sum(p.numel() for p in model.parameters())
        if self.gpu:
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            model = DistributedDataParallel(config, DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=args.use_distributed_optimizer), model.to(device))
            self.optimizer = get_megatron_optimizer(OptimizerConfig(
                optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, bf16=args.bf16,
                clip_grad=args.clip_grad, use_distributed_optimizer=args.use_distributed_optimizer), [model])
        else:
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        self.model = model
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if args.lr_warmup_iters else args.lr, max_lr=args.lr, min_lr=args.min_lr,
            lr_warmup_steps=args.lr_warmup_iters, lr_decay_steps=args.train_iters, lr_decay_style=args.lr_decay_style,
            start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=args.train_iters,
            wd_incr_style="constant")
        self.train_data, self.valid_data = _datasets(args, self.tokenizer)
        self.iteration = 0

    def _loss(self, batch):
        from .megatron.batch import cp_token_mean_loss, shard_batch

        b = shard_batch({k: v.to(self.device) for k, v in batch.items()}, algo=self.cp_cfg.algo,
                        cp_group=self.cp_group)
        per_token = self.model(b["tokens"], b["position_ids"], None, labels=b["labels"])
        return cp_token_mean_loss(per_token.float(), b["loss_mask"], self.dp_cp_group)

    def train_step(self):
        args = self.args
        batches = list(_micro_batches(self.train_data, args, self.iteration, self.dp_rank))
        if self.gpu:
            self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        total = 0.0
        for batch in batches:
            loss, reported = self._loss(batch)
            (loss / len(batches)).backward()
            total += reported.item() / len(batches)
        if self.gpu:
            self.model.finish_grad_sync()              # sums over data-parallel x CP (per-token loss)
            self.optimizer.step()
        else:
            for p in self.model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self.dp_cp_group)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), args.clip_grad)
            self.optimizer.step()
        self.scheduler.step(1)
        self.iteration += 1
        return total

    @torch.no_grad()
    def evaluate(self):
        losses = [self._loss(b)[1].item() for it in range(self.args.eval_iters)
                  for b in _micro_batches(self.valid_data, self.args, it, self.dp_rank)]
        return sum(losses) / len(losses)

    # -------------------------------------------------------------------------------------- checkpoints
    def _state(self):
        model = self.model.module if self.gpu else self.model
        sd = {"model": model.sharded_state_dict(prefix="model."), "iteration": self.iteration,
              "scheduler": self.scheduler.state_dict(), "args_seq_length": self.args.seq_length}
        if self.gpu:
            sd["optimizer"] = self.optimizer.sharded_state_dict(sd["model"])
        else:                                          # identical on every rank: saved once, as common state
            sd["optimizer"] = self.optimizer.state_dict()
        return sd

    def save(self):
        from megatron.core import dist_checkpointing

        path = os.path.join(self.args.save, f"iter_{self.iteration:07d}")
        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(self._state(), path)
        dist.barrier()
        if dist.get_rank() == 0:
            with open(os.path.join(self.args.save, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(self.iteration))
        return path

    def load(self):
        from megatron.core import dist_checkpointing

        tracker = os.path.join(self.args.load, "latest_checkpointed_iteration.txt")
        if not os.path.exists(tracker):
            raise ValueError(f"--load {self.args.load}: no latest_checkpointed_iteration.txt there")
        with open(tracker) as f:
            it = int(f.read().strip())
        loaded = dist_checkpointing.load(self._state(), os.path.join(self.args.load, f"iter_{it:07d}"))
        model = self.model.module if self.gpu else self.model
        model.load_state_dict(loaded["model"], strict=False)
        self.optimizer.load_state_dict(loaded["optimizer"])
        self.scheduler.load_state_dict(loaded["scheduler"])
        self.iteration = loaded["iteration"]


def _memory_gb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def train(args) -> list[float]:
    """Run the training loop in an initialised process group; returns the per-iteration losses."""
    import json

    from megatron.core import parallel_state as ps

    world, rank = dist.get_world_size(), dist.get_rank()
    cp_cfg = _validate(args, world)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu" and _recompute_kwargs(args):
        from .megatron.cpu_shim import apply_cpu_recompute_shim
        apply_cpu_recompute_shim()
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                 context_parallel_size=args.context_parallel_size)
    trainer = Trainer(args, cp_cfg, device)
    if args.load:
        trainer.load()
    if rank == 0:
        print(f"megatron-cp-pretrain: {world} ranks (TP {args.tensor_model_parallel_size}, CP "
              f"{args.context_parallel_size}, DP {args.data_parallel_size}), algo {cp_cfg.algo}, "
              f"{trainer.n_params / 1e6:.2f}M parameters, {'bf16 GPU' if args.bf16 else device.type + ' fp32'}; "
              f"TFLOP/s counts {_flops_per_iter.__doc__.strip()}", flush=True)
    losses, flops, saved = [], _flops_per_iter(args, trainer.n_params), False
    result = _result_start(args, world, cp_cfg, device, trainer.n_params, trainer.tokenizer.vocab_size, flops)
    t0 = time.perf_counter()
    while trainer.iteration < args.train_iters:
        t_step = time.perf_counter()
        loss = trainer.train_step()
        losses.append(loss)
        it = trainer.iteration
        if result is not None:
            if device.type == "cuda":                  # the step's last kernels belong to its time
                torch.cuda.synchronize()
            result["iterations"].append(it)
            result["losses"].append(loss)
            result["step_times_s"].append(time.perf_counter() - t_step)
        if it % args.log_interval == 0:
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / args.log_interval
            t0 = time.perf_counter()
            row = {"iteration": it, "loss": loss, "lr": trainer.scheduler.get_lr(trainer.optimizer.param_groups[0]),
                   "tokens_per_s": args.global_batch_size * args.seq_length / dt,
                   "tflops_per_gpu": flops / dt / world / 1e12, "mem_gb": _memory_gb(device)}
            if rank == 0:
                print(f"iter {it:6d} | loss {loss:.6f} | lr {row['lr']:.3e} | {row['tokens_per_s']:.0f} tokens/s | "
                      f"{row['tflops_per_gpu']:.3f} TFLOP/s/GPU | mem {row['mem_gb']:.2f} GB", flush=True)
                if args.log_json:
                    with open(args.log_json, "a") as f:
                        f.write(json.dumps(row) + "\n")
        if args.eval_interval and it % args.eval_interval == 0:
            val = trainer.evaluate()
            if rank == 0:
                print(f"iter {it:6d} | validation loss {val:.6f}", flush=True)
        saved = bool(args.save and args.save_interval and it % args.save_interval == 0)
        if saved:
            trainer.save()
        if args.exit_interval and it % args.exit_interval == 0:
            break
    if args.save and not saved:
        trainer.save()
    ps.destroy_model_parallel()
    if result is not None:
        result["peak_mem_gb"] = _memory_gb(device)
        _write_result(args, "ok")
    return losses


# ------------------------------------------------------------------------------------------------ --result-json
_RESULT: dict | None = None   # this process's run record, filled while training, written by rank 0


def _result_start(args, world: int, cp_cfg, device, n_params: int, vocab: int, flops: float) -> dict | None:
    """The run's settings, recorded before the first step (so a failing run still reports them)."""
    global _RESULT
    if not getattr(args, "result_json", None):
        return None
    import platform

    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))   # torchrun's ranks per node; spawn: all local
    env = os.environ
    _RESULT = {
        "algo": cp_cfg.algo, "cp_size": args.context_parallel_size, "tp_size": args.tensor_model_parallel_size,
        "dp_size": args.data_parallel_size, "world_size": world, "nodes": max(1, world // max(1, local)),
        "ranks_per_node": local, "gpus": world if device.type == "cuda" else 0, "device": device.type,
        "gpu_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "cp_grid": args.cp_grid, "cp_gpus_per_node": args.cp_gpus_per_node,
        "seq_length": args.seq_length, "micro_batch_size": args.micro_batch_size,
        "global_batch_size": args.global_batch_size, "num_layers": args.num_layers,
        "hidden_size": args.hidden_size, "num_attention_heads": args.num_attention_heads,
        "num_query_groups": args.num_query_groups or args.num_attention_heads,
        "head_dim": args.hidden_size // args.num_attention_heads,
        "ffn_hidden_size": args.ffn_hidden_size or 4 * args.hidden_size, "vocab_size": vocab,
        "n_params": n_params, "bf16": args.bf16, "use_distributed_optimizer": args.use_distributed_optimizer,
        "recompute": _recompute_kwargs(args) or None, "train_iters": args.train_iters,
        "flops_per_iter": flops, "configs": args.config or [], "argv": sys.argv[1:],
        "hostname": platform.node(), "slurm_job_id": env.get("SLURM_JOB_ID"),
        "slurm_nodelist": env.get("SLURM_JOB_NODELIST"), "torch": torch.__version__,
        "iterations": [], "losses": [], "step_times_s": [],
    }
    return _RESULT


def _write_result(args, status: str, error: str | None = None) -> None:
    """Rank 0 writes the run record with its timing summary and exit status (ok | failed)."""
    import json
    import statistics

    path = getattr(args, "result_json", None)
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    if not path or rank != 0:
        return
    r = dict(_RESULT) if _RESULT is not None else {        # failed before training: the flags are all we know
        "algo": args.context_parallel_algo, "cp_size": args.context_parallel_size,
        "seq_length": args.seq_length, "configs": args.config or [], "argv": sys.argv[1:],
        "world_size": int(os.environ.get("WORLD_SIZE", args.nproc or 1)), "losses": []}
    times = r.get("step_times_s", [])
    timed = times[1:] if len(times) > 1 else times   # the first step pays for warm-up (allocations, NCCL set-up)
    median = statistics.median(timed) if timed else None
    tokens = (r.get("global_batch_size") or 0) * (r.get("seq_length") or 0)
    r.update(status=status, exit_code=0 if status == "ok" else 1, error=error,
             step_time_median_s=median, step_time_timed_iterations=len(timed),
             tokens_per_s=tokens / median if median else None,
             tflops_per_gpu=(r["flops_per_iter"] / median / r["world_size"] / 1e12
                             if median and r.get("flops_per_iter") else None),
             final_loss=r["losses"][-1] if r.get("losses") else None)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(r, f, indent=1)
    os.replace(tmp, path)                             # readers never see half a file


def _run(rank: int, world: int, args, port: int | None, target=None) -> None:
    """One rank: set up the process group (torchrun's env or the spawn's), train, exit non-zero on error."""
    try:
        if port is not None:
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        gpu = torch.cuda.is_available()
        if gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        else:
            from .megatron.cpu_shim import apply_cpu_shims
            apply_cpu_shims()
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", 1))))
        dist.init_process_group("nccl" if gpu else "gloo",
                                timeout=datetime.timedelta(seconds=args.dist_timeout))
        (target or train)(args)
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - report, then leave without waiting for peers
        print(f"[rank {os.environ.get('RANK', rank)}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        try:
            _write_result(args, "failed", f"{type(e).__name__}: {e}")
        except Exception:  # noqa: BLE001 - the exit status matters more than the record
            pass
        os._exit(1)


def _compare_cp1(argv: list[str], args) -> None:
    """Run CP = 1 and then the requested run as subprocesses; print their losses side by side."""
    import json
    import subprocess
    import tempfile

    tmp = tempfile.mkdtemp(prefix="megatron-cp-compare-")
    base = [x for x in argv if x != "--compare-cp1"]
    runs = {"CP=1": base + ["--nproc", "1", "--context-parallel-size", "1", "--log-json", f"{tmp}/cp1.jsonl"]
            + (["--result-json", f"{tmp}/cp1.json"] if args.result_json else []),   # keep the user's for this run
            "this run": base + ["--log-json", f"{tmp}/cp.jsonl"]}
    for name, flags in runs.items():
        print(f"== {name}: megatron-cp-pretrain {' '.join(flags)}", flush=True)
        if subprocess.call([sys.executable, "-m", "megatron_cp_plugin.pretrain", *flags]) != 0:
            sys.exit(f"megatron-cp-pretrain: the {name} run failed")
    cp1, cp = ([json.loads(x)["loss"] for x in open(f"{tmp}/{n}.jsonl")] for n in ("cp1", "cp"))
    print(f"\n{'iteration':>9} {'loss CP=1':>12} {'loss ' + args.context_parallel_algo:>20} {'difference':>11}")
    for i, (a, b) in enumerate(zip(cp1, cp)):
        print(f"{(i + 1) * args.log_interval:>9} {a:>12.6f} {b:>20.6f} {b - a:>11.2e}")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.compare_cp1 and "RANK" not in os.environ:
        _compare_cp1(argv, args)
        return
    launch(args, train)


def launch(args, target) -> None:
    """Run target(args) on every rank: under torchrun as is, else in --nproc spawned processes."""
    if "RANK" in os.environ or not args.nproc or args.nproc == 1:
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            from .bench._common import free_port
            os.environ["MASTER_PORT"] = str(free_port())
        _run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None, target)
        return
    import multiprocessing

    import torch.multiprocessing as mp

    from .bench._common import free_port
    try:
        mp.spawn(_run, args=(args.nproc, args, free_port(), target), nprocs=args.nproc)
    except Exception as e:  # noqa: BLE001 - a rank failed: make sure none is left behind, then fail
        for child in multiprocessing.active_children():
            child.kill()
        print(f"megatron-cp-pretrain: {e}", file=sys.stderr, flush=True)
        os._exit(1)


if __name__ == "__main__":
    main()
