"""The one place our Triton kernels are launched from (merge, accumulate, surrogate O), so that the rank
benchmark's op counter (bench/rank_replay.py) counts each launch once, as it counts an attention kernel call."""
from __future__ import annotations


def launch(kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs)."""
    return kernel[grid](*args, **kwargs)
