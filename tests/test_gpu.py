"""Tests that need GPUs: skipped on CPU machines with a message saying so; run them on the GPU machine."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(GPUS == 0, reason="needs CUDA GPUs: NCCL correctness at S=64k runs on the GPU machine only")
def test_every_algorithm_on_nccl_bf16_64k():
    n = min(GPUS, 2)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}",
           os.path.join(os.path.dirname(__file__), "nccl_check.py"), "--seq", "65536"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-5000:]
