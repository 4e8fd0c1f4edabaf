"""Which device and process-group backend a rank uses: the one place that decides it.

By default every rank owns one GPU and talks NCCL (gloo and the CPU where torch sees no GPU). With the opt-in
shared-GPU mode (`--share-gpu`, or MCP_SHARE_GPU=1 in the ranks' environment under torchrun / SLURM), more
ranks than GPUs run on one machine: local rank r uses GPU r mod (GPUs present) and the process group is gloo
with CUDA tensors. The opt-in only allows sharing: where every local rank still has a GPU of its own (2 ranks
on 2 GPUs with MCP_SHARE_GPU=1 set for a whole test suite) the ranks run as without it, on NCCL, and their
record and timings say so (`shares_gpu`). gloo runs collectives on CUDA tensors (it stages them through host
memory); its point-to-point calls do not take CUDA tensors, so `comm.Ring` stages those itself. The mode exists
to verify on one GPU what runs on many (every algorithm, the trainer, generation, faults, determinism); its
timings say nothing about speed and are labelled so.
"""
from __future__ import annotations

import os
import sys

import torch

SHARE_FLAG = "--share-gpu"
SHARE_ENV = "MCP_SHARE_GPU"
NOT_REPRESENTATIVE = "ranks share a GPU (--share-gpu): timings are not representative"


def gpu_count() -> int:
    """GPUs torch can use here (0 without CUDA). Creates no CUDA context, so a launcher may fork after it."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_capacity_gib() -> float | None:
    """GiB a process can have on the smallest GPU here as the driver reports it: nvidia-smi's memory.total less
    memory.reserved (the driver's and firmware's share; total alone where the driver does not report it), or None
    where nvidia-smi does not answer. Through nvidia-smi so that the launching process creates no CUDA context,
    which would hold memory on GPU 0 for the whole run. (An H200 sold as 141 GB gave CUDA 139.8 GiB.)"""
    import subprocess
    for fields in ("memory.total,memory.reserved", "memory.total"):
        try:
            out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=30)
            per_gpu = [[float(x) for x in line.split(",")] for line in out.stdout.strip().splitlines()]
        except (OSError, ValueError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and per_gpu:
            return min(mib[0] - sum(mib[1:]) for mib in per_gpu) / 1024
    return None


def sharing(flag: bool = False) -> bool:
    """Whether this process runs in the shared-GPU mode: the flag, or MCP_SHARE_GPU set (and not 0)."""
    return bool(flag) or os.environ.get(SHARE_ENV, "") not in ("", "0")


def enable_sharing() -> None:
    """Opt in for this process and every process it starts (spawned ranks, torchrun children)."""
    os.environ[SHARE_ENV] = "1"


def too_many_ranks(local_ranks: int, share: bool, what: str = "--nproc") -> str | None:
    """One line when `local_ranks` ranks on this machine would need more GPUs than it has and the shared mode
    was not asked for; None when they fit (or there is no GPU: the ranks run on the CPU)."""
    gpus = gpu_count()
    if gpus == 0 or local_ranks <= gpus or share:
        return None
    return (f"{what} {local_ranks}: this machine has {gpus} GPU{'s' if gpus > 1 else ''}; pass {SHARE_FLAG} to "
            f"run {local_ranks} ranks on {'them' if gpus > 1 else 'it'} over gloo (verification, not speed), "
            f"or use at most {gpus} ranks")


def refuse_unshared_ranks(prog: str, share: bool) -> None:
    """In a rank that torchrun or SLURM started (no launcher of ours checked before it): exit 2 when this
    machine's ranks outnumber its GPUs without the opt-in; local rank 0 says why in one line."""
    refuse = too_many_ranks(local_world(), share, "ranks per node")
    if refuse:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"{prog}: error: {refuse} ({SHARE_ENV}=1 under torchrun)", file=sys.stderr, flush=True)
        os._exit(2)


def local_world() -> int:
    """Ranks on this machine: torchrun's LOCAL_WORLD_SIZE, SLURM's tasks per node, else WORLD_SIZE."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank_device(local_rank: int) -> torch.device:
    """The device of a rank: its own GPU (shared ones wrap round), or the CPU without GPUs."""
    gpus = gpu_count()
    return torch.device("cuda", local_rank % gpus) if gpus else torch.device("cpu")


def graphs_capture_collectives() -> bool:
    """Whether a CUDA graph can hold this process group's collectives: NCCL's, yes; gloo's (ranks sharing a
    GPU) stage through host memory, which a capture cannot contain, so decoding there runs eagerly."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_backend() == "nccl"


def shares_gpu(share: bool, local_ranks: int | None = None) -> bool:
    """Whether ranks really share a GPU: the opt-in, and more ranks on this machine (`local_ranks`, default
    local_world()) than GPUs. Decides the backend, the run record's `shared_gpu` and the timings' label."""
    gpus = gpu_count()
    return bool(share) and gpus > 0 and (local_world() if local_ranks is None else local_ranks) > gpus


def backend(share: bool, local_ranks: int | None = None) -> str:
    """NCCL for one GPU per rank; gloo on CPUs and when ranks share GPUs (NCCL refuses two ranks on one GPU)."""
    return "nccl" if gpu_count() and not shares_gpu(share, local_ranks) else "gloo"
