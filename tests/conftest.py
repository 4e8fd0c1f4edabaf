"""Shared fixtures: `pools(P)` gives a DistPool of P gloo processes, started once per test module."""
from __future__ import annotations

import os

import pytest
import torch

# Triton kernels (flash_decode, DeFT) are tested on CPU through Triton's interpreter. triton.jit reads the
# variable when a kernel module is imported, so it is set here, before any test imports one; gloo workers
# inherit it. On GPUs the real kernels run.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    # On a GPU machine every multi-rank run (trainer, generation, benchmarks under torchrun) shares the GPUs
    # present over gloo (devices.py), so that one GPU runs the whole suite; a test of the refusal unsets it.
    os.environ.setdefault("MCP_SHARE_GPU", "1")

from .dist_pool import DistPool


@pytest.fixture(scope="module")
def pools():
    made = {}

    def get(p):
        if p not in made:
            made[p] = DistPool(p)
        return made[p]

    yield get
    for pool in made.values():
        pool.close()
