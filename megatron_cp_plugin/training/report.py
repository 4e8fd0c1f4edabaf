"""What a run reports: the model FLOPs per iteration, peak memory, log lines, and the --result-json record
(settings before the first step, losses and step times while training, a timing summary and the exit status
at the end, also when the run fails)."""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys

import torch
import torch.distributed as dist

from .. import devices
from .config import recompute_kwargs, rope_fusion_on, sharding_strategy

_RESULT: dict | None = None   # this process's run record, filled while training, written by rank 0


def flops_per_iter(args, n_params: int, attention_tokens_sq: float | None = None) -> float:
    """6 x params x tokens (matmuls, fwd + bwd) + 6 x layers x seq x hidden x tokens (causal attention).

    attention_tokens_sq: packed documents (--reset-attention-mask): the iteration's sum over documents of their
    squared (padded) lengths, replacing seq x tokens (= the rows' S^2) in the attention term."""
    tokens = args.global_batch_size * args.seq_length
    sq = tokens * args.seq_length if attention_tokens_sq is None else attention_tokens_sq
    return 6.0 * n_params * tokens + 6.0 * args.num_layers * args.hidden_size * sq


def memory_gb(device) -> float:
    """Peak memory of this rank: CUDA's allocator on GPUs, the process's peak resident set on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def log_row(row: dict, log_json: str | None, gpu: bool = True) -> None:
    """Rank 0's line for one logged iteration, and its JSON line when --log-json names a file. Without a GPU the
    rate is per rank (a CPU process), not per GPU (the JSON key stays tflops_per_gpu)."""
    print(f"iter {row['iteration']:6d} | loss {row['loss']:.6f} | lr {row['lr']:.3e} | {row['tokens_per_s']:.0f} "
          f"tokens/s | {row['tflops_per_gpu']:.3f} TFLOP/s/{'GPU' if gpu else 'rank'} | mem {row['mem_gb']:.2f} GB",
          flush=True)
    if log_json:
        with open(log_json, "a") as f:
            f.write(json.dumps(row) + "\n")


def start_record(args, world: int, cp_cfg, device, n_params: int, vocab: int, flops: float) -> dict | None:
    """The run's settings, recorded before the first step (so a failing run still reports them)."""
    global _RESULT
    if not getattr(args, "result_json", None):
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))   # torchrun's ranks per node; spawn: all local
    env = os.environ
    _RESULT = {
        "algo": cp_cfg.algo, "cp_size": args.context_parallel_size, "tp_size": args.tensor_model_parallel_size,
        "dp_size": args.data_parallel_size, "world_size": world, "nodes": max(1, world // max(1, local)),
        "ranks_per_node": local, "device": device.type,
        # What ran: distinct GPUs used (ranks beyond a node's GPUs wrap round onto them, devices.rank_device),
        # and whether two ranks shared one (gloo then; timings say nothing of speed).
        "gpus": 0 if device.type != "cuda" else max(1, world // max(1, local)) * min(local, devices.gpu_count()),
        "shared_gpu": device.type == "cuda" and devices.shares_gpu(devices.sharing(), local),
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "gpu_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "cp_grid": args.cp_grid, "cp_gpus_per_node": args.cp_gpus_per_node,
        "cp_group_tokens": getattr(args, "cp_group_tokens", None),
        "seq_length": args.seq_length, "micro_batch_size": args.micro_batch_size,
        "global_batch_size": args.global_batch_size, "num_layers": args.num_layers,
        "hidden_size": args.hidden_size, "num_attention_heads": args.num_attention_heads,
        "num_query_groups": args.num_query_groups or args.num_attention_heads,
        "head_dim": args.hidden_size // args.num_attention_heads,
        "ffn_hidden_size": args.ffn_hidden_size or 4 * args.hidden_size, "vocab_size": vocab,
        "n_params": n_params, "bf16": args.bf16, "use_distributed_optimizer": args.use_distributed_optimizer,
        "fsdp_sharding_strategy": sharding_strategy(args),
        "recompute": recompute_kwargs(args) or None,
        "offload_layer_inputs": bool(getattr(args, "offload_layer_inputs", False)), "train_iters": args.train_iters,
        "rope_fusion": rope_fusion_on(args, device.type == "cuda"),
        "flops_per_iter": flops, "configs": getattr(args, "config", None) or [],
        "argv": sys.argv[1:], "hostname": platform.node(), "slurm_job_id": env.get("SLURM_JOB_ID"),
        "slurm_nodelist": env.get("SLURM_JOB_NODELIST"), "torch": torch.__version__,
        "iterations": [], "losses": [], "step_times_s": [], "mem_after_step_gib": [],
    }
    return _RESULT


def write_record(args, status: str, error: str | None = None, peak_mem_gb: float | None = None,
                 exit_code: int | None = None) -> None:
    """Rank 0 writes the run record with its timing summary and exit status (ok | failed; exit_code: the
    process's, when it is not the default 0 / 1)."""
    path = getattr(args, "result_json", None)
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    if not path or rank != 0:
        return
    r = dict(_RESULT) if _RESULT is not None else {        # failed before training: the flags are all we know
        "algo": args.context_parallel_algo, "cp_size": args.context_parallel_size,
        "seq_length": args.seq_length, "configs": getattr(args, "config", None) or [], "argv": sys.argv[1:],
        "world_size": int(os.environ.get("WORLD_SIZE", args.nproc or 1)), "losses": []}
    if peak_mem_gb is not None:
        r["peak_mem_gb"] = peak_mem_gb
    times = r.get("step_times_s", [])
    timed = times[1:] if len(times) > 1 else times   # the first step pays for warm-up (allocations, NCCL set-up)
    median = statistics.median(timed) if timed else None
    tokens = (r.get("global_batch_size") or 0) * (r.get("seq_length") or 0)
    r.update(status=status, exit_code=exit_code if exit_code is not None else 0 if status == "ok" else 1, error=error,
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
