"""Tests that need GPUs: skipped on CPU machines with a message saying so; run them on the GPU machine.

Every GPU count present among 2, 4, 8 runs tests/nccl_check.py: every algorithm, Attention2D on every grid of
that count, bf16 and issue 15's fp16 large activations, against fp64 and single-GPU attention in the same dtype.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
SEQ = 32768                                     # divisible by 2P for every P below (zigzag) and by P (cyclic)


@pytest.mark.parametrize("n", (2, 4, 8))
def test_every_algorithm_and_grid_on_nccl(n):
    if GPUS == 0:
        pytest.skip("needs CUDA GPUs: NCCL correctness runs on the GPU machine only (scripts/gpu_numerics_check.sh)")
    if n > GPUS:
        pytest.skip(f"needs {n} GPUs, {GPUS} present")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}",
           os.path.join(os.path.dirname(__file__), "nccl_check.py"), "--seq", str(SEQ)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "NCCL_NVLS_ENABLE": "0"})
    print(r.stdout)                             # one line per case and grid: shown by pytest -rP
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-5000:]
