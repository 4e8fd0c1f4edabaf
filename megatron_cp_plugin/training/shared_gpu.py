"""Megatron's coalesced collectives when ranks share a GPU (devices.py: gloo with CUDA tensors).

Megatron's DDP buckets, distributed optimizer and Megatron-FSDP issue their reduce-scatters and all-gathers
inside torch's `_coalescing_manager`. gloo's coalesced collectives on CUDA tensors crash the process
(SIGSEGV in `_coalescing_manager`'s exit, from DDP's parameter all-gather, at world 1 too; H100, torch 2.11),
while the same collectives issued one by one work. `install()` replaces the manager in those modules with
one that issues them one by one: the collectives inside the block run as called, their works are recorded,
and the handle's wait() (or the block's end, for a synchronous block) waits for all of them, which is what
the coalesced handle promised. NCCL runs never install it.
"""
from __future__ import annotations

import contextlib
import functools
import importlib

import torch.distributed as dist

_PENDING: list | None = None          # works of the collectives issued inside the innermost block
_installed = False
_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_gather", "broadcast",
                "_all_gather_base", "_reduce_scatter_base")
_MODULES = ("megatron.core.distributed.param_and_grad_buffer",
            "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer")


def _recording(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        work = fn(*args, **kwargs)
        if _PENDING is not None and work is not None:
            _PENDING.append(work)
        return work
    call._recording = True
    return call


class _Handle:
    """What the coalescing manager hands out: wait() waits for every collective of its block."""

    def __init__(self, works: list):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()
        self.works.clear()


@contextlib.contextmanager
def one_by_one(group=None, device=None, async_ops=False):
    """torch's `_coalescing_manager` signature; the collectives inside run uncoalesced (see the module)."""
    global _PENDING
    outer, _PENDING = _PENDING, []
    handle = _Handle(_PENDING)
    try:
        yield handle
    finally:
        _PENDING = outer
    if not async_ops:
        handle.wait()


def buffer_modules():
    """Megatron's modules that issue the coalesced collectives (DDP / distributed optimizer, Megatron-FSDP), those
    this megatron-core has."""
    for name in _MODULES:
        try:
            yield importlib.import_module(name)
        except ImportError:                       # a megatron-core without this module
            continue


def install() -> None:
    """Record the collectives and swap the manager in Megatron's buffer modules (idempotent)."""
    global _installed
    if _installed:
        return
    for name in _COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None and not getattr(fn, "_recording", False):
            setattr(dist, name, _recording(fn))
    for module in buffer_modules():
        if hasattr(module, "_coalescing_manager"):
            module._coalescing_manager = one_by_one
        for alias in ("dist_all_gather_func", "dist_reduce_scatter_func"):   # bound at import: wrap them too
            fn = getattr(module, alias, None)
            if fn is not None and not getattr(fn, "_recording", False):
                setattr(module, alias, _recording(fn))
    _installed = True
