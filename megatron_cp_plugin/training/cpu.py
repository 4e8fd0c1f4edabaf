"""Megatron's GPU training code (DDP, the distributed optimizer, Megatron-FSDP, their checkpoints) on a CPU.

The trainer runs the same megatron-core objects on both devices, so that the CPU tests exercise what runs on
GPUs. megatron-core 0.16.1 hard-codes CUDA in places that do not depend on a GPU's presence for their
meaning: scalars and flat buffers made with `device="cuda"` or `torch.cuda.current_device()`, `.cuda()`
copies, dtype checks by `tensor.type() == "torch.cuda.FloatTensor"`, and CUDA streams and events that order
communication against computation. With no GPU, `install_cuda_on_cpu()`:
- places every tensor that asks for a CUDA device on the CPU (a torch-function mode rewrites the `device`
  argument of factory functions and of `.to(...)`, makes `.cuda()` and `.pin_memory()` identities, and
  names CPU tensors' types as their CUDA types so those dtype checks take the same branch);
- turns streams and events into no-ops: on a CPU every operation runs in program order on one thread, which
  is what any stream ordering was there to guarantee; for that to hold for communication too, Megatron's
  coalesced collectives (Megatron-FSDP's parameter prefetch, the DDP buckets) complete before they return
  (gloo runs async collectives on its own threads, and a bucket that a GPU run orders by streams could then
  be freed or refilled while gloo still writes into it: 1 run in 7 of the FSDP resume test crashed in
  gloo's run loop with heap corruption before this);
- makes `torch.cuda.current_device()` answer device 0 (mapped to the CPU like the rest) and
  synchronize / empty_cache no-ops.
What cannot be the same on a CPU: NCCL (gloo instead) and the CUDA random-number generator (checkpoints save
the CPU generators only). It changes nothing where torch sees a GPU.
"""
from __future__ import annotations

import contextlib
import logging

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_mode: "_CudaOnCpu | None" = None


def _on_cpu(device):
    """CUDA devices (by name, object or index) -> the CPU; anything else unchanged."""
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


class _CudaOnCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _on_cpu(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False              # pinning needs a CUDA runtime
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.record_stream:
            return None
        if func is torch.Tensor.to:
            args = tuple(_on_cpu(a) if isinstance(a, (str, torch.device)) else a for a in args)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)                        # "torch.FloatTensor" -> "torch.cuda.FloatTensor"
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


@contextlib.contextmanager
def _coalesced_in_order(group=None, device=None, async_ops=False):
    """torch's _coalescing_manager with the coalesced collectives finished on exit, whatever async_ops asked
    for; the caller's later cm.wait() finds nothing left to wait for."""
    with _ORIGINAL_COALESCING_MANAGER(group, device, async_ops=False) as cm:
        yield cm


_ORIGINAL_COALESCING_MANAGER = torch.distributed._coalescing_manager


class _Stream:
    """A CUDA stream on a CPU: work is already ordered, so every method is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args):
        pass

    def wait_event(self, *args):
        pass

    def record_event(self, *args):
        return _Event()

    def synchronize(self):
        pass

    def query(self):
        return True


class _Event(_Stream):
    def record(self, *args):
        pass

    def wait(self, *args):
        pass


def finish_coalesced_collectives() -> None:
    """Megatron's coalesced collectives (DDP buckets, Megatron-FSDP's prefetch) complete before they return
    (see the module docstring; ranks sharing a GPU need more: training/shared_gpu.py)."""
    from .shared_gpu import buffer_modules
    for module in buffer_modules():
        if hasattr(module, "_coalescing_manager"):
            module._coalescing_manager = _coalesced_in_order


def install_cuda_on_cpu() -> bool:
    """Install the CPU stand-ins (idempotent) when there is no GPU; returns whether they are active."""
    global _mode
    if torch.cuda.is_available():
        return False
    if _mode is None:
        cuda = torch.cuda
        cuda.current_device = lambda: 0
        cuda.synchronize = lambda *a, **k: None
        cuda.empty_cache = lambda: None
        cuda.Stream = _Stream
        cuda.Event = _Event
        cuda.current_stream = lambda *a, **k: _Stream()
        cuda.default_stream = lambda *a, **k: _Stream()
        cuda.stream = lambda *a, **k: contextlib.nullcontext()
        # Megatron-FSDP warns once per rank that its device (the CPU) is not "cuda:0": expected here.
        logging.getLogger("megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp").setLevel(logging.ERROR)
        finish_coalesced_collectives()
        _mode = _CudaOnCpu()
        _mode.__enter__()                             # for the rest of the process (training ranks only)
    return True
