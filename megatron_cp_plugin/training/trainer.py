"""The model, its data-parallel wrapper, optimizer, schedule and data of one run, and one training step.

GPUs and CPUs build the same megatron-core objects: a GPTModel with the plugin's attention, wrapped in
Megatron's DDP (with --use-distributed-optimizer: ZeRO-1) or in Megatron-FSDP (--use-megatron-fsdp: ZeRO-1/2/3
by --data-parallel-sharding-strategy), both over the data-parallel x context-parallel group, and Megatron's
optimizer (Adam, gradient clipping, bf16 main parameters on GPUs). Without a GPU, `training.cpu` lets that code
run on gloo. The loss is the global token mean: every CP rank sums its tokens' losses and divides by the loss
tokens of all ranks, and gradients are summed, not averaged, over data-parallel x CP (`calculate_per_token_loss`).
"""
from __future__ import annotations

import contextlib
import hashlib
import os

import torch
import torch.distributed as dist

from .config import document_unit, sharding_strategy, transformer_config


def index_cache_dir(args) -> str:
    """Where GPTDataset keeps its sample indexes: under the run directory (--save) or else beside the first
    data file, in a folder keyed on every .bin/.idx's path, size and modification time. Megatron keys its cache
    on the dataset's description only, so re-running megatron-cp-preprocess to the same prefix with another
    corpus reused stale indexes (IndexError: index 991 is out of bounds)."""
    key = hashlib.sha1()
    for prefix in args.data_path:
        for ext in (".bin", ".idx"):
            st = os.stat(prefix + ext)
            key.update(f"{os.path.abspath(prefix + ext)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    home = args.save or os.path.dirname(os.path.abspath(args.data_path[0]))
    return os.path.join(home, ".index_cache", key.hexdigest()[:16])


def build_datasets(args, tokenizer):
    """(train, valid) GPT datasets: --data-path's .bin/.idx files, or Megatron's mock data without it."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    mock = args.data_path is None
    cfg = GPTDatasetConfig(random_seed=args.seed, sequence_length=args.seq_length,
                           blend=None if mock else (args.data_path, None), split="98,2,0", tokenizer=tokenizer,
                           reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                           create_attention_mask=False,      # causal is implicit; an [S, S] mask per sample is not
                           path_to_cache=None if mock else index_cache_dir(args))
    evals = (args.train_iters // args.eval_interval + 1) * args.eval_iters if args.eval_interval else 0
    sizes = [args.train_iters * args.global_batch_size, evals * args.global_batch_size or None, None]
    train, valid, _ = BlendedMegatronDatasetBuilder(MockGPTDataset if mock else GPTDataset, sizes, lambda: True,
                                                    cfg).build()
    return train, valid


def micro_batches(dataset, args, it: int, dp_rank: int):
    """The micro-batches of iteration `it` for this data-parallel rank: sample indices are a function of the
    iteration, so a resumed run reads exactly what the uninterrupted one would have."""
    per_iter, mb = args.global_batch_size, args.micro_batch_size
    for m in range(per_iter // (mb * args.data_parallel_size)):
        first = it * per_iter + (m * args.data_parallel_size + dp_rank) * mb
        samples = [dataset[(first + j) % len(dataset)] for j in range(mb)]
        yield {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in
               ("tokens", "labels", "loss_mask", "position_ids")}


def model_params(model, tp: int) -> int:
    """The model's parameter count (not this rank's): tensor-parallel weights hold 1 / TP of their rows or
    columns on each rank (Megatron marks them `tensor_model_parallel`), the rest are replicated."""
    return sum(p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1) for p in model.parameters())


class Trainer:
    """One run's model, optimizer, scheduler and data; `iteration` counts the optimizer steps taken."""

    def __init__(self, args, cp_cfg, device):
        from megatron.core import parallel_state as ps
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        from ..megatron.model import build_gpt
        from ..megatron.tokenizer import ByteTokenizer, padded_vocab_size

        self.args, self.cp_cfg, self.device = args, cp_cfg, device
        if device.type == "cuda" and dist.get_backend() == "gloo":     # ranks sharing a GPU (devices.py)
            from . import shared_gpu
            shared_gpu.install()
        self.gpu = device.type == "cuda"
        self.fsdp = sharding_strategy(args)            # None: Megatron's DDP
        self.distributed_optimizer = bool(args.use_distributed_optimizer or self.fsdp)
        # --overlap-grad-reduce for Megatron's DDP (with or without the distributed optimizer): buckets of >= 40M
        # parameters reduced as the last micro-batch's backward fills them; the earlier micro-batches run under
        # no_sync (train_step)
        self.overlap_grad_reduce = bool(getattr(args, "overlap_grad_reduce", False)) and not self.fsdp
        # --overlap-param-gather (distributed optimizer): the step's updated parameters are gathered bucket by
        # bucket in the next forward's pre-hooks (megatron-core's DDP); `params_in_sync` around saves and evaluations
        self.overlap_param_gather = bool(getattr(args, "overlap_param_gather", False)) and not self.fsdp
        self.tokenizer = ByteTokenizer(args.vocab_size)
        self.cp_group = ps.get_context_parallel_group()
        self.dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)
        self.dp_rank = ps.get_data_parallel_rank()
        self.tp_rank, self.tp_size = ps.get_tensor_model_parallel_rank(), args.tensor_model_parallel_size
        config = transformer_config(args, self.gpu)
        torch.manual_seed(args.seed)
        if self.gpu:                                   # Megatron initialises GPU weights from its RNG tracker
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
            model_parallel_cuda_manual_seed(args.seed)
        # As Megatron-LM: 257 rows do not split over TP = 2; every TP size gets the same padded table.
        self.vocab_rows = padded_vocab_size(self.tokenizer.vocab_size, args.make_vocab_size_divisible_by,
                                            self.tp_size)
        model = build_gpt(config, cp_cfg, vocab_size=self.vocab_rows,
                          seq_length=args.max_position_embeddings or args.seq_length, cp_group=self.cp_group)
        self.gpt = model                               # the GPTModel inside the wrappers
        self.offload = None                            # --offload-layer-inputs: the hooks (training/offload.py)
        if getattr(args, "offload_layer_inputs", False):
            from .offload import install
            self.offload = install(model.decoder, device)
        self.n_params = model_params(model, self.tp_size)
        if args.bf16:
            # As Megatron-LM: every parameter in bf16 (Megatron's local RMSNorm would keep fp32 weights, and
            # the distributed optimizer's checkpoint mapping assumes one dtype per buffer), fp32 outputs.
            from megatron.core.transformer.module import Float16Module
            model = Float16Module(config, model)
        self.model = self._wrap(config, model.to(device))
        self.optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, bf16=args.bf16,
            params_dtype=config.params_dtype, clip_grad=args.clip_grad,
            use_distributed_optimizer=self.distributed_optimizer), [self.model])
        # torch's fused Adam on GPUs where megatron-core picked torch's foreach one (no TE or Apex): 2.7B at 64k on
        # 2 x H200, ZeRO-1, the foreach step took ~55 ms of GPU time a step (megatron/compat.py)
        self.fused_adam = False
        if device.type == "cuda" and not self.fsdp:
            from ..megatron.compat import use_fused_adam
            self.fused_adam = use_fused_adam(self.optimizer)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if args.lr_warmup_iters else args.lr, max_lr=args.lr, min_lr=args.min_lr,
            lr_warmup_steps=args.lr_warmup_iters, lr_decay_steps=args.train_iters, lr_decay_style=args.lr_decay_style,
            start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=args.train_iters,
            wd_incr_style="constant")
        self.train_data, self.valid_data = build_datasets(args, self.tokenizer)
        self.iteration = 0
        # --reset-attention-mask --reset-position-ids: micro-batches become packed documents (docs/packed.md)
        self.document_unit = document_unit(args, cp_cfg.algo)
        self.attention_tokens_sq = 0.0                 # sum of squared packed document lengths, this rank, trained

    def _wrap(self, config, model):
        """Megatron's DDP, or Megatron-FSDP with the requested sharding, over data-parallel x CP."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        from ..megatron.compat import fsdp_grad_dtype_kwargs

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=self.distributed_optimizer,
            use_megatron_fsdp=bool(self.fsdp), data_parallel_sharding_strategy=self.fsdp or "no_shard",
            # Megatron-FSDP as Megatron-LM's recipes run it: gradients reduce-scattered per layer during the
            # backward; ZeRO-3 weights gathered per layer just before use (without this, the optimizer step
            # gathers all of them at once and they stay until the next forward). With "optim" (nothing but
            # the optimizer state sharded) 0.16.1 trains wrong with either overlap: both stay off there.
            overlap_grad_reduce=self.fsdp in ("optim_grads", "optim_grads_params") or self.overlap_grad_reduce,
            bucket_size=None if self.fsdp else getattr(self.args, "ddp_bucket_size", None),
            overlap_param_gather=self.fsdp == "optim_grads_params" or self.overlap_param_gather,
            # fp32 main gradients under Megatron-FSDP on every megatron-core version (megatron/compat.py)
            **(fsdp_grad_dtype_kwargs(DistributedDataParallelConfig, True) if self.fsdp else {}))
        if not self.fsdp:
            return DistributedDataParallel(config, ddp_config, model)
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
        # optim_grads_params gathers each TransformerLayer's parameters just before it runs (the adapter's
        # default unit); the embedding and output layer stay in the root unit.
        return FullyShardedDataParallel(config, ddp_config, model, device=self.device)

    def _loss(self, batch, training: bool = False):
        from ..megatron.batch import cp_token_mean_loss, pack_documents, shard_batch

        if self.document_unit is not None:
            # EOD tokens end documents: [b, S] -> [1, b * S] with cu_seqlens. GPTDataset's own reset flags stay
            # off; this resets the positions and the attention (per-document causal masks) instead.
            batch = pack_documents(batch, eod=self.tokenizer.eod, unit=self.document_unit)
            if training:
                lengths = batch["cu_seqlens"][1:] - batch["cu_seqlens"][:-1]
                self.attention_tokens_sq += float((lengths.double() ** 2).sum())
        elif training:
            self.attention_tokens_sq += float(batch["tokens"].shape[0] * batch["tokens"].shape[1] ** 2)
        b = shard_batch({k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()},
                        algo=self.cp_cfg.algo, cp_group=self.cp_group)
        per_token = self.model(b["tokens"], b["position_ids"], None, labels=b["labels"],
                               packed_seq_params=b.get("packed_seq_params"))
        return cp_token_mean_loss(per_token.float(), b["loss_mask"], self.dp_cp_group)

    def train_step(self) -> float:
        """One optimizer step over this iteration's micro-batches; returns the global token-mean loss."""
        batches = list(micro_batches(self.train_data, self.args, self.iteration, self.dp_rank))
        if self.offload is not None:
            self.offload.reset()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        total = 0.0
        for i, batch in enumerate(batches):
            quiet = self.overlap_grad_reduce and i < len(batches) - 1
            with self.model.no_sync() if quiet else contextlib.nullcontext():
                loss, reported = self._loss(batch, training=True)
                (loss / len(batches)).backward()
            total += reported.item() / len(batches)
        self.model.finish_grad_sync()                  # sums over data-parallel x CP (per-token loss)
        self.optimizer.step()                          # clips, steps Adam, gathers the updated parameters
        self.scheduler.step(1)
        self.iteration += 1
        return total

    @contextlib.contextmanager
    def params_in_sync(self):
        """With --overlap-param-gather the parameters the last step updated arrive during the next forward, bucket
        by bucket: gather them all now (megatron-core's `disable_forward_pre_hook`, as Megatron-LM does around its
        saves and evaluations) and re-arm the pre-hooks after. Without it, nothing to do."""
        if not self.overlap_param_gather:
            yield
            return
        self.model.disable_forward_pre_hook(param_sync=True)
        try:
            yield
        finally:
            self.model.enable_forward_pre_hook()

    @torch.no_grad()
    def evaluate(self) -> float:
        with self.params_in_sync():
            losses = [self._loss(b)[1].item() for it in range(self.args.eval_iters)
                      for b in micro_batches(self.valid_data, self.args, it, self.dp_rank)]
        return sum(losses) / len(losses)

    def save(self) -> str:
        from .checkpoint import save_checkpoint
        with self.params_in_sync():
            return save_checkpoint(self)

    def load(self) -> None:
        from .checkpoint import load_checkpoint
        load_checkpoint(self)
