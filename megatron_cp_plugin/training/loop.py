"""The training loop of one rank: set up the parallel groups and the Trainer, resume, step, log, evaluate,
save, and record the run (training.report)."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .. import devices
from . import report
from .checkpoint import check_resumable, check_save_dir
from .config import recompute_kwargs, sharding_strategy, validate_args
from .trainer import Trainer


def _layout_words(args) -> str:
    strategy = sharding_strategy(args)
    if strategy:
        return f"Megatron-FSDP {strategy}"
    return "DDP + distributed optimizer" if args.use_distributed_optimizer else "DDP"


def train(args) -> list[float]:
    """Run the training loop in an initialised process group; returns the per-iteration losses."""
    from megatron.core import parallel_state as ps

    world, rank = dist.get_world_size(), dist.get_rank()
    cp_cfg = validate_args(args, world)
    check_save_dir(args)                               # never overwrite a checkpoint unasked
    if args.load:
        check_resumable(args)                          # a checkpoint of another layout fails here, not mid-load
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    if not gpu:
        from .cpu import install_cuda_on_cpu
        install_cuda_on_cpu()
        if recompute_kwargs(args):
            from ..megatron.cpu_shim import apply_cpu_recompute_shim
            apply_cpu_recompute_shim()
    if args.deterministic_mode:
        # Strict: an op without a deterministic kernel fails the run instead of silently breaking the promise.
        # The attention kernels read this switch too (kernels/local_attn.py).
        torch.use_deterministic_algorithms(True)
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                 context_parallel_size=args.context_parallel_size,
                                 distributed_timeout_minutes=args.dist_timeout / 60)  # its groups' collectives too
    trainer = Trainer(args, cp_cfg, device)
    if args.load:
        trainer.load()
    flops = report.flops_per_iter(args, trainer.n_params)
    if rank == 0:
        print(f"megatron-cp-pretrain: {world} ranks (TP {args.tensor_model_parallel_size}, CP "
              f"{args.context_parallel_size}, DP {args.data_parallel_size}), "
              f"{f'algo {cp_cfg.algo}' if args.context_parallel_size > 1 else 'local attention (CP = 1)'}, "
              f"{trainer.n_params / 1e6:.2f}M parameters, {_layout_words(args)}"
              f"{' + full recompute, layer inputs on the host' if trainer.offload is not None else ''}, "
              f"{'bf16' if args.bf16 else 'fp32'} {'GPU' if gpu else 'CPU'}"
              f"{'; ' + devices.NOT_REPRESENTATIVE if gpu and devices.shares_gpu(devices.sharing()) else ''}"
              f"; TFLOP/s counts "
              f"{report.flops_per_iter.__doc__.split(chr(10))[0].strip()}"
              f"{' (attention: sum of squared document lengths)' if trainer.document_unit else ''}", flush=True)
    losses, saved, packed_flops = [], False, []
    result = report.start_record(args, world, cp_cfg, device, trainer.n_params, trainer.vocab_rows, flops)
    if result is not None:
        result["fused_adam"] = trainer.fused_adam      # torch's fused Adam kernel (megatron/compat.use_fused_adam)
        # Megatron's DDP: gradient buckets, reduced during the backward with --overlap-grad-reduce
        result["grad_buckets"] = len(getattr(trainer.model, "bucket_groups", ())) or None
        result["overlap_grad_reduce"] = trainer.overlap_grad_reduce
        result["overlap_param_gather"] = trainer.overlap_param_gather
    t0 = time.perf_counter()
    while trainer.iteration < args.train_iters:
        t_step = time.perf_counter()
        loss = trainer.train_step()
        losses.append(loss)
        it = trainer.iteration
        if result is not None:
            if gpu:                                    # the step's last kernels belong to its time
                torch.cuda.synchronize()
            result["iterations"].append(it)
            result["losses"].append(loss)
            result["step_times_s"].append(time.perf_counter() - t_step)
            if gpu:                                    # between steps: weights, gradients, optimizer state (issue 35)
                result["mem_after_step_gib"].append(torch.cuda.memory_allocated(device) / 2**30)
            if trainer.offload is not None:            # --offload-layer-inputs: what one step kept on the host
                result["offloaded_gib_per_step"] = trainer.offload.bytes_per_step / 2**30
                result["offloaded_tensors_per_step"] = trainer.offload.tensors
        if it % args.log_interval == 0:
            if gpu:
                torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / args.log_interval
            t0 = time.perf_counter()
            if trainer.document_unit is not None:       # packed: the documents' attention, summed over DP
                sq = torch.tensor([trainer.attention_tokens_sq], dtype=torch.float64, device=device)  # NCCL: on GPU
                dist.all_reduce(sq, group=ps.get_data_parallel_group())
                trainer.attention_tokens_sq = 0.0
                flops = report.flops_per_iter(args, trainer.n_params, float(sq) / args.log_interval)
                if result is not None:
                    packed_flops.append(flops)
                    result["flops_per_iter"] = sum(packed_flops) / len(packed_flops)
            if rank == 0:
                report.log_row({"iteration": it, "loss": loss,
                                "lr": trainer.scheduler.get_lr(trainer.optimizer.param_groups[0]),
                                "tokens_per_s": args.global_batch_size * args.seq_length / dt,
                                "tflops_per_gpu": flops / dt / world / 1e12, "mem_gb": report.memory_gb(device)},
                               args.log_json, gpu)
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
    peak = report.memory_gb(device)
    ps.destroy_model_parallel()
    if result is not None:
        report.write_record(args, "ok", peak_mem_gb=peak)
    return losses
