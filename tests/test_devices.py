"""devices.py: more ranks than GPUs are refused in the launching process with one line naming --share-gpu; with
it (or MCP_SHARE_GPU=1) ranks share the GPUs over gloo. On a CPU machine the GPU count is patched; on a GPU
machine the refusal runs for real (tests/test_gpu.py runs the algorithms in the shared mode)."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch

from megatron_cp_plugin import devices


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(devices, "gpu_count", lambda: 1)
    monkeypatch.delenv(devices.SHARE_ENV, raising=False)


def test_more_ranks_than_gpus_need_the_opt_in(one_gpu, monkeypatch):
    line = devices.too_many_ranks(2, devices.sharing())
    assert line is not None and "--share-gpu" in line and "1 GPU" in line and "\n" not in line
    assert devices.too_many_ranks(1, False) is None                    # fits
    assert devices.too_many_ranks(4, devices.sharing(True)) is None    # the flag
    monkeypatch.setenv(devices.SHARE_ENV, "1")
    assert devices.sharing() and devices.too_many_ranks(4, devices.sharing()) is None   # torchrun / SLURM
    assert devices.backend(True, 2) == "gloo" and devices.backend(False) == "nccl"
    assert devices.shares_gpu(True, 2) and not devices.shares_gpu(False, 2)
    assert devices.rank_device(3) == torch.device("cuda", 0)          # every rank on the one GPU
    monkeypatch.setattr(devices, "gpu_count", lambda: 0)
    assert devices.too_many_ranks(8, False) is None and devices.backend(False) == "gloo"   # CPU ranks


def test_the_opt_in_shares_only_when_ranks_outnumber_the_gpus(monkeypatch):
    """MCP_SHARE_GPU=1 set for a whole job or suite: ranks that each have a GPU still run on NCCL (and are not
    labelled shared); only ranks beyond the GPUs share them over gloo. Per machine: local ranks, not the world."""
    monkeypatch.setattr(devices, "gpu_count", lambda: 2)
    monkeypatch.setenv(devices.SHARE_ENV, "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")                             # 2 nodes x 2 ranks: a GPU each
    assert not devices.shares_gpu(devices.sharing()) and devices.backend(devices.sharing()) == "nccl"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert devices.shares_gpu(devices.sharing()) and devices.backend(devices.sharing()) == "gloo"
    assert devices.rank_device(2) == torch.device("cuda", 0)          # the third rank wraps round
    monkeypatch.setattr(devices, "gpu_count", lambda: 0)
    assert not devices.shares_gpu(True, 8) and devices.backend(True, 8) == "gloo"   # CPU ranks: never shared


def test_the_launcher_refuses_before_any_rank_starts(one_gpu, capsys, tmp_path):
    import importlib
    launch = importlib.import_module("megatron_cp_plugin.training.launch")   # the package exports a launch()

    started = []
    args = argparse.Namespace(nproc=2, share_gpu=False, result_json=str(tmp_path / "r.json"),
                              context_parallel_algo="ring", context_parallel_size=2, seq_length=256, config=None)
    with pytest.raises(SystemExit) as e:
        launch.launch(args, started.append, prog="megatron-cp-generate")
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and started == [] and len(err) == 1, err
    assert err[0].startswith("megatron-cp-generate: error: --nproc 2: ") and "--share-gpu" in err[0]
    assert '"exit_code": 2' in (tmp_path / "r.json").read_text()


def test_bench_model_refuses_before_any_run(one_gpu):
    from megatron_cp_plugin.bench import model

    with pytest.raises(SystemExit, match="megatron-cp-bench: error: --nproc 2: .*--share-gpu"):
        model.main(["--nproc", "2", "--algos", "ring"])


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() != 1,
                    reason="needs exactly one GPU: the real refusal of --nproc 2 without --share-gpu")
def test_on_one_gpu_nproc_2_is_refused_in_one_line_and_runs_with_the_flag(tmp_path):
    env = {**os.environ, devices.SHARE_ENV: "0"}
    base = [sys.executable, "-W", "ignore", "-m", "megatron_cp_plugin.pretrain", "--nproc", "2", "--num-layers", "1",
            "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128", "--train-iters", "2",
            "--bf16", "--context-parallel-algo", "ring"]
    r = subprocess.run(base, capture_output=True, text=True, timeout=120, env=env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "--share-gpu" in lines[0], r.stderr[-2000:]
    r = subprocess.run(base + ["--share-gpu"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert devices.NOT_REPRESENTATIVE in r.stdout and "iter      2" in r.stdout


def _one_by_one_block(rank, world):
    """In a pool rank (the patch stays in that process): collectives inside the stand-in manager are recorded
    and waited for by the handle, as a coalesced handle's wait() would."""
    import megatron.core.distributed.param_and_grad_buffer as buffers
    import torch.distributed as dist

    from megatron_cp_plugin.training import shared_gpu

    shared_gpu.install()
    assert buffers._coalescing_manager is shared_gpu.one_by_one
    x, out = torch.full((4,), rank + 1.0), torch.empty(4 * world)
    y = x.clone()                # its own tensor: an in-place all-reduce of x could race the gather still reading x
    with buffers._coalescing_manager(None, async_ops=True) as cm:
        buffers.dist_all_gather_func(out, x, async_op=True)      # Megatron's alias, bound at its import
        dist.all_reduce(y, async_op=True)
    recorded = len(cm.works)
    cm.wait()
    with buffers._coalescing_manager(None, async_ops=False) as sync:
        dist.all_reduce(torch.ones(1), async_op=True)
    return recorded, len(cm.works), len(sync.works), out.tolist(), y.tolist()


def test_shared_gpu_runs_megatrons_coalesced_collectives_one_by_one(pools):
    for rank, (recorded, left, left_sync, out, x) in enumerate(pools(2).run(_one_by_one_block)):
        assert recorded == 2 and left == 0 and left_sync == 0
        assert out == [1.0] * 4 + [2.0] * 4 and x == [3.0] * 4


def test_a_torchrun_rank_refuses_in_one_line_from_local_rank_0(one_gpu, monkeypatch, capsys):
    exits = []
    monkeypatch.setattr(devices.os, "_exit", lambda code: exits.append(code))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for local in ("0", "1"):
        monkeypatch.setenv("LOCAL_RANK", local)
        devices.refuse_unshared_ranks("megatron-cp-bench", devices.sharing())
    err = capsys.readouterr().err.strip().splitlines()
    assert exits == [2, 2] and len(err) == 1 and err[0].startswith("megatron-cp-bench: error: ranks per node 2")
    assert "--share-gpu" in err[0] and "MCP_SHARE_GPU=1" in err[0]
    exits.clear()
    devices.refuse_unshared_ranks("megatron-cp-bench", True)             # opted in: nothing to refuse
    assert exits == []
