"""Everything megatron-core 0.16.1 needs to run on a machine without a GPU, in one place.

Applied by the pretraining entry point only when torch sees no CUDA device; it changes nothing otherwise.
- dist_checkpointing's filesystem writer calls torch.cuda.synchronize() before copying tensors to host
  memory; with no GPU there is nothing to wait for, so it becomes a no-op (CPU torch builds raise instead);
- its save finalisation makes a small tensor on torch.cuda.current_device() to all-reduce failure flags:
  current_device() answers the CPU.
(RoPE's `.cuda()` calls are avoided by `rope.CPRotaryEmbedding`, not patched.)
"""
from __future__ import annotations

import torch

_applied = False


def apply_cpu_shims() -> bool:
    """Install the shims when there is no GPU; returns whether they are active."""
    global _applied
    if torch.cuda.is_available():
        return False
    if not _applied:
        torch.cuda.synchronize = lambda device=None: None
        torch.cuda.current_device = lambda: torch.device("cpu")
        _applied = True
    return True


def apply_cpu_recompute_shim() -> None:
    """Megatron's activation checkpointing saves and restores the CUDA RNG state around the recomputation; a
    CPU torch build raises on that, and with no GPU there is no CUDA state to keep (the CPU state is still
    saved and restored). Applied by pretraining only for recompute without a GPU."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: None
    mrandom._set_cuda_rng_state = lambda *a, **k: None
