"""megatron-cp-pretrain's memory check before any rank starts, its override, the allocator default and the GPU
capacity it reads (training/memory_check.py, devices.gpu_capacity_gib); GPUs are simulated, nothing runs on one."""
from __future__ import annotations

import importlib
import subprocess
from pathlib import Path

import pytest

from megatron_cp_plugin import devices
from megatron_cp_plugin.training import memory_check
from megatron_cp_plugin.training.config import parse_args

REPO = Path(__file__).resolve().parents[1]
H200 = 139.8                     # GiB the H200s of 2026-11-25 gave CUDA (sold as 141 GB)
GPT3_13B = ["--config", str(REPO / "configs/gpt3-13b.toml"), "--seq-length", "32768", "--context-parallel-size", "2"]


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has n GPUs of `gib` GiB (devices.gpu_count and gpu_capacity_gib)."""
    def set_(n, gib=H200):
        monkeypatch.setattr(devices, "gpu_count", lambda: n)
        monkeypatch.setattr(devices, "gpu_capacity_gib", lambda: gib)
    return set_


def _sizes(flags, cp=2):
    """{layout name: planned GiB per GPU} of the config's layout and the layouts the check may name instead."""
    from megatron_cp_plugin.bench import launch_plan, plan
    a = parse_args(flags)
    m = plan.model_from_args(a)
    lays = [launch_plan.config_layout(a)] + launch_plan.candidates(a, m, cp, "plugin")
    return {lay.name: (lay, plan.estimate(m, lay, cp).total / plan.GiB) for lay in lays}


def test_a_run_that_does_not_fit_is_refused_naming_the_layouts_that_do(gpus):
    """GPT-3 13B at 32k on 2 GPUs with the configs' distributed optimizer (ZeRO-1), on GPUs just too small for it:
    refused in one line naming, with their flags, the layouts the planner says fit; each named one then passes."""
    from megatron_cp_plugin.bench import launch_plan
    sizes = _sizes(GPT3_13B)
    mine = sizes.pop("zero1")[1]
    cap = mine + memory_check.HEADROOM_GIB - 1.0                         # ZeRO-1 misses by 1 GiB
    fitting = [(lay, gib) for lay, gib in sizes.values() if gib + memory_check.HEADROOM_GIB <= cap]
    assert fitting                                                       # FSDP's sharded layouts
    gpus(2, cap)
    line = memory_check.refusal(parse_args(GPT3_13B), 2)
    assert line.startswith(f"the memory plan (zero1, CP = 2) needs {mine:.1f} GiB + 4 GiB headroom per GPU of "
                           f"{cap:.1f} GiB; these fit: "), line
    assert line.endswith("; --no-memory-check starts it anyway") and "\n" not in line
    for lay, gib in fitting[:3]:
        assert f"{lay.name} ({gib:.1f} GiB: {' '.join(launch_plan.layout_args(lay))})" in line
        assert memory_check.refusal(parse_args(GPT3_13B + launch_plan.layout_args(lay)), 2) is None
    gpus(2, min(g for _, g in sizes.values()) + memory_check.HEADROOM_GIB - 0.1)      # nothing fits
    assert memory_check.refusal(parse_args(GPT3_13B), 2).endswith(
        "; no layout fits: use more GPUs or a shorter --seq-length; --no-memory-check starts it anyway")


def test_fitting_runs_no_gpu_tp_and_the_override_are_not_refused(gpus):
    gpus(2)
    assert memory_check.refusal(parse_args(["--config", str(REPO / "configs/tiny.toml")]), 2) is None
    assert memory_check.refusal(parse_args(GPT3_13B + ["--no-memory-check"]), 2) is None
    assert memory_check.refusal(parse_args(GPT3_13B + ["--tensor-model-parallel-size", "2"]), 4) is None
    gpus(0)                                        # CPU ranks: the host's memory, not checked
    assert memory_check.refusal(parse_args(GPT3_13B), 2) is None
    gpus(2, None)                                  # nvidia-smi did not answer
    assert memory_check.refusal(parse_args(GPT3_13B), 2) is None


def test_ranks_sharing_a_gpu_add_up(gpus, monkeypatch):
    """Two ranks on one GPU (--share-gpu) need twice one rank's plan: a run that fits one GPU per rank is refused
    when both share it."""
    monkeypatch.delenv(devices.SHARE_ENV, raising=False)
    flags = ["--config", str(REPO / "configs/gpt3-760m.toml"), "--seq-length", "32768", "--context-parallel-size", "2"]
    from megatron_cp_plugin.bench import launch_plan, plan
    a = parse_args(flags)
    one = plan.estimate(plan.model_from_args(a), launch_plan.config_layout(a), 2).total / plan.GiB
    gpus(1, one + memory_check.HEADROOM_GIB + 1)                       # one rank fits, two do not
    assert memory_check.refusal(parse_args(flags + ["--share-gpu"]), 2).startswith(
        "the memory plan (zero1, CP = 2, 2 ranks per GPU) needs ")
    gpus(2, one + memory_check.HEADROOM_GIB + 1)
    assert memory_check.refusal(parse_args(flags + ["--share-gpu"]), 2) is None


def test_pretrain_refuses_before_any_rank_starts(gpus, monkeypatch, capsys, tmp_path):
    """megatron-cp-pretrain --nproc 2: one line on stderr, exit 2, the run record says why, launch() never runs."""
    launch = importlib.import_module("megatron_cp_plugin.training.launch")
    gpus(2)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("a rank was started"))
    res = tmp_path / "res.json"
    with pytest.raises(SystemExit) as e:
        launch.main(GPT3_13B + ["--nproc", "2", "--mock-data", "--result-json", str(res)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megatron-cp-pretrain: error: the memory plan (zero1, CP = 2)"), err
    assert "the memory plan" in res.read_text()


def test_allocator_default_and_its_override():
    env = {}
    assert memory_check.allocator_env(env)["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    for mine in ("backend:cudaMallocAsync", ""):              # the user's setting, "" (torch's default) included
        assert memory_check.allocator_env({"PYTORCH_CUDA_ALLOC_CONF": mine})["PYTORCH_CUDA_ALLOC_CONF"] == mine


def test_gpu_capacity_from_nvidia_smi(monkeypatch):
    """total less reserved, the smallest GPU; total alone where the driver has no memory.reserved; None without
    nvidia-smi."""
    answers = []

    def fake(cmd, **kw):
        out, rc = answers.pop(0)
        if isinstance(out, BaseException):
            raise out
        return subprocess.CompletedProcess(cmd, rc, out, "")
    monkeypatch.setattr(subprocess, "run", fake)
    answers[:] = [("143771, 616\n81559, 512\n", 0)]
    assert devices.gpu_capacity_gib() == pytest.approx((81559 - 512) / 1024)
    answers[:] = [('Field "memory.reserved" is not a valid field to query.\n', 2), ("81559\n", 0)]
    assert devices.gpu_capacity_gib() == pytest.approx(81559 / 1024)
    answers[:] = [(FileNotFoundError("nvidia-smi"), 0), (FileNotFoundError("nvidia-smi"), 0)]
    assert devices.gpu_capacity_gib() is None


def test_13b_at_64k_on_two_h200s_fits_only_with_the_layer_inputs_on_the_host(gpus):
    """Issue 35 item 3: GPT-3 13B at 64k over CP = 2 fits no layout that keeps its layer inputs on the GPU (FSDP
    ZeRO-3 + full recompute plans 142.7 GiB); with them in host memory (--offload-layer-inputs) it plans what 32k
    does, the optimizer step's 135.2 GiB. The check names that layout with its flags, and the layout passes it."""
    from megatron_cp_plugin.bench import launch_plan, plan
    flags = [f if f != "32768" else "65536" for f in GPT3_13B]
    gpus(2, H200)
    line = memory_check.refusal(parse_args(flags), 2)
    off = plan.Layout("fsdp-optim_grads_params", 1, True, True)
    args = launch_plan.layout_args(off)
    assert args[-1] == "--offload-layer-inputs" and "--recompute-granularity" in args
    gib = plan.estimate(plan.model_from_args(parse_args(flags)), off, 2).total / plan.GiB
    assert f"these fit: {off.name} ({gib:.1f} GiB: {' '.join(args)})" in line, line
    assert memory_check.refusal(parse_args(flags + args), 2) is None
    rc = [f for f in args if f != "--offload-layer-inputs"]
    assert memory_check.refusal(parse_args(flags + rc), 2) is not None      # the same without offload: refused
    assert launch_plan.config_layout(parse_args(flags + args)) == off
    m = plan.model_from_args(parse_args(flags))
    assert plan.recommend(m, 2, H200) == "fsdp-optim_grads_params +recompute +offload"
    # the Megatron-LM path has no such flag: its candidates never offload, its layout names refuse it
    assert not any(lay.offload for lay in launch_plan.candidates(parse_args(flags), m, 2, "megatron-lm"))
    assert launch_plan.parse_layout("fsdp+recompute+offload", "plugin") == off
    with pytest.raises(ValueError, match=r"LAYOUT 'fsdp\+recompute\+offload': expected"):
        launch_plan.parse_layout("fsdp+recompute+offload", "megatron-lm")
    from megatron_cp_plugin.megatron_lm.flags import megatron_lm_flags
    from megatron_cp_plugin.training.config import build_parser
    with pytest.raises(ValueError, match="--offload-layer-inputs is megatron-cp-pretrain's"):
        megatron_lm_flags(parse_args(flags + args), build_parser(), world_size=2, layout="fsdp+recompute")


def test_a_run_that_fits_only_with_smaller_grouped_calls_gets_them(gpus):
    """GPT-3 13B at 128k, CP = 16, attention2d-no, Megatron-FSDP ZeRO-3: on 79.1-GiB GPUs the check passes with
    --cp-group-tokens set to 16384 (the default rule's 32768 does not fit), on 139.8-GiB ones leaves it unset (the
    default); a given cap is kept, and one that does not fit is refused."""
    flags = ["--config", str(REPO / "configs/gpt3-13b.toml"), "--seq-length", "131072", "--context-parallel-algo",
             "attention2d-no", "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
    for gib, cap in ((79.1, 16384), (H200, None)):
        gpus(16, gib)
        a = parse_args(flags)
        assert memory_check.refusal(a, 16) is None and a.cp_group_tokens == cap
    gpus(16, 79.1)
    a = parse_args(flags + ["--cp-group-tokens", "8192"])
    assert memory_check.refusal(a, 16) is None and a.cp_group_tokens == 8192
    assert memory_check.refusal(parse_args(flags + ["--cp-group-tokens", "32768"]), 16).startswith(
        "the memory plan (fsdp-optim_grads_params, CP = 16) needs")
