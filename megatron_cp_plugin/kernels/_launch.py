"""The one place our Triton kernels are launched from (merge, accumulate, surrogate O), so that the rank
benchmark's op counter (bench/rank_replay.py) counts each launch once, as it counts an attention kernel call;
and whether the decode step's kernels launch with programmatic dependent launch (`pdl`)."""
from __future__ import annotations

import functools
import os

import torch

PDL = True
"""Process-wide switch for `pdl`, as torch.backends' flags are: the decode benchmarks' --no-pdl clears it before any
kernel runs, for the with/without comparison. Kernels read it at launch, never in between."""


def launch(kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs)."""
    return kernel[grid](*args, **kwargs)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device (persistent grids size themselves by it)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _hopper_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl(device: torch.device) -> bool:
    """Whether a decode kernel on `device` launches with programmatic dependent launch (PDL): a CUDA device of
    compute capability 9.0 or newer (griddepcontrol is Hopper's), compiled (not Triton's CPU interpreter), PDL on.

    Why: a graphed decode step is ~350 small kernels (1 H100, 8B shape, 32k: 0.24 ms of its 5.91 idle between
    them, each GEMV ramping up after the kernel before it drains). With PDL a kernel's programs start while the
    previous kernel's last ones run: they load what does not depend on it (a GEMV its first weight tile, a norm
    its weight) and then wait (`griddepcontrol.wait`, which returns once the previous grid has finished and its
    writes are visible). Every PDL kernel waits before it reads anything an earlier kernel wrote and before it
    writes anything, so stream order holds for every reader, PDL or not."""
    if not PDL or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _hopper_or_newer(device.index if device.index is not None else torch.cuda.current_device())
