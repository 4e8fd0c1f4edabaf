"""Tests that need GPUs: skipped on CPU machines with a message saying so; run them on the GPU machine.

Every rank count among 2, 3, 4, 8 runs tests/nccl_check.py (every algorithm and the ring-te baseline,
Attention2D on every grid of that count, tree decoding's merge variants, bf16, fp16 and issue 15's fp16
large activations, against fp64 and single-GPU attention in the same dtype) and tests/packed_nccl_check.py
(packed THD documents): over NCCL where that many GPUs are present, else in the shared-GPU mode (ranks share
the GPUs over gloo with CUDA tensors, devices.py), so that one GPU checks every algorithm at P = 2, 3 and 4.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
HERE = os.path.dirname(__file__)


def _torchrun(n, script, *flags):
    """Run a check script on n ranks: NCCL with a GPU each, else sharing the GPUs (MCP_SHARE_GPU=1, gloo)."""
    if GPUS == 0:
        pytest.skip("needs a CUDA GPU: the NCCL / shared-GPU checks run on the GPU machine only "
                    "(scripts/gpu_tests.sh)")
    shared = n > GPUS
    if shared and n > 4:
        pytest.skip(f"{n} ranks on {GPUS} GPU(s): the shared-GPU mode runs up to 4 ranks (P = 8 needs 8 GPUs)")
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "MCP_SHARE_GPU": "1" if shared else "0",
           "OMP_NUM_THREADS": "2"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           os.path.join(HERE, script), *flags]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    print(r.stdout)                             # one line per case and grid: shown by pytest -rP
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-5000:]
    return r.stdout


@pytest.mark.parametrize("n", (2, 3, 4, 8))
def test_every_algorithm_grid_and_decode_variant_against_fp64(n):
    # Long sequences over NCCL; 3072 tokens (divisible by 2P for P = 2, 3, 4) when the ranks share one GPU.
    seq = ["--seq", "32760" if n == 3 else "32768"] if n <= GPUS else ["--seq", "3072"]
    out = _torchrun(n, "nccl_check.py", *seq, "--cases", "bf16", "fp16", "fp16-large", "--decode")
    for name in ("ring ", "ring-te ", "burst ", "attention2d-no grid", "attention2d-o grid", "tree_decode allgather"):
        assert name in out, f"{name.strip()} did not run"
    if n == 4:
        assert "grid 4x1" in out and "grid 1x4" in out and "grid 2x2" in out     # rectangular and square grids
    if n <= GPUS:                                   # one GPU a rank: the NVLink kernels ran (or said why not)
        assert "split-MLP reduce peer_sum" in out or "tree_decode peer P=" in out and "not run" in out


@pytest.mark.parametrize("n", (2, 3, 4))
def test_packed_documents_every_algorithm_against_fp64(n):
    # tokens - 8 x mean-doc - 2 units must divide by the unit 2P = 4, 6, 8 (the check's long document is 8 x mean)
    tokens = ("32760" if n == 3 else "32768") if n <= GPUS else "8400"
    _torchrun(n, "packed_nccl_check.py", "--tokens", tokens, "--mean-doc", "384")
