"""megatron-cp-bench plan: its byte counts against the trainer's real tensors (CPU processes, the GPU code
path), its layouts for GPT-3 175B, and the layouts the GPT-3 configs' comments name."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_cp_plugin.bench import plan
from megatron_cp_plugin.training.config import parse_args

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--num-query-groups", "4",
         "--seq-length", "1024", "--micro-batch-size", "1", "--bf16", "--context-parallel-algo", "ring"]


def _probe(tmp_path, *flags, nproc=2):
    out = tmp_path / "probe.json"
    r = subprocess.run([sys.executable, "-W", "ignore", "-m", "tests.plan_probe", str(out), *SMALL, *flags,
                        "--nproc", str(nproc)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("zero,flags", [("zero1", ["--use-distributed-optimizer"]),
                                        ("fsdp-optim_grads_params", ["--use-megatron-fsdp"])])
def test_planner_bytes_match_the_trainers_tensors(tmp_path, zero, flags):
    got = _probe(tmp_path, *flags)
    m = plan.model_from_args(parse_args(SMALL))
    assert got["n_params"] == m.params                               # the parameter count is exact
    est = plan.estimate(m, plan.Layout(zero), gpus=2)
    static = est.weights + est.grads + est.optimizer
    if zero == "fsdp-optim_grads_params":
        # Between steps Megatron-FSDP also holds gathered layers (prefetched for the next forward), part of
        # what the planner counts as transient.
        assert static <= got["static_bytes"] <= static + est.transient, (got, static, est.transient)
    else:                                                            # buffers' padding: well under 1 %
        assert got["static_bytes"] == pytest.approx(static, rel=0.01), (got, static)
    # What autograd keeps for the backward, the RMSNorms' own tensors aside (CPU torch keeps fp32 copies where
    # the GPU's fused kernel keeps its bf16 input): per layer and at the loss, within 1 %.
    t = est.tokens
    expect = t * (m.layers * m.layer_activation_bytes_per_token(norms=False) + m.final_activation_bytes_per_token(
        norms=False))
    if zero == "fsdp-optim_grads_params":
        # The linears also keep the gathered weights of the units not yet released (how many depends on the
        # prefetch's timing): within what the planner allows for gathered units.
        gathered = got["saved_rest_bytes"] - expect
        assert 0 < gathered <= est.transient, (got, expect, est.transient)
    else:
        assert got["saved_rest_bytes"] == pytest.approx(expect, rel=0.01), (got, expect)


def _run_cli(capsys, *argv):
    assert plan.main([str(a) for a in argv]) == 0
    return capsys.readouterr().out


def test_gpt3_175b_on_64_gpus_of_80_gb(capsys, tmp_path):
    out = _run_cli(capsys, "--config", REPO / "configs/gpt3-175b.toml", "--gpus", 64, "--gpu-mem", 80,
                   "--json", tmp_path / "p.json")
    rows = {r["layout"]: r for r in json.loads((tmp_path / "p.json").read_text())["rows"]}
    assert "175.20B parameters" in out
    # ZeRO-1 keeps bf16 weights and fp32 gradients whole: 6 bytes x 175B per GPU, at any GPU count.
    assert rows["zero1"]["weights"] + rows["zero1"]["grads"] == pytest.approx(6 * 175.2e9 / 2**30, rel=0.01)
    assert not rows["zero1"]["fits"] and not rows["zero1 +recompute"]["fits"]
    assert rows["fsdp-optim_grads_params +recompute"]["fits"]
    assert "fits: fsdp-optim_grads_params +recompute" in out
    for r in rows.values():
        assert r["total"] == pytest.approx(sum(r[k] for k in ("weights", "grads", "optimizer", "activations",
                                                              "transient")))
    totals = [rows[z]["weights"] + rows[z]["grads"] + rows[z]["optimizer"] for z in plan.ZERO_LAYOUTS]
    assert totals == sorted(totals, reverse=True)                   # more sharding, fewer bytes
    assert rows["zero1 +recompute"]["activations"] < rows["zero1"]["activations"] / 10
    assert {"pp2-zero1", "pp32-zero1 +recompute"} <= rows.keys()
    # Pipeline stages: the first stage's weights hold its layers and the embedding.
    m = plan.model_from_args(parse_args(["--config", str(REPO / "configs/gpt3-175b.toml")]))
    assert rows["pp8-zero1"]["weights"] * 2**30 == pytest.approx(2 * (12 * m.layer_params + m.vocab * m.hidden),
                                                                 rel=1e-6)


def test_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        plan.main(["--gpus", "0", "--gpu-mem", "80"])
    with pytest.raises(ValueError, match="pipeline stages"):
        plan.estimate(plan.Model(4, 64, 8, 8, 256, 257, 256), plan.Layout("zero1", pp=2), gpus=3)
    with pytest.raises(ValueError, match="layout"):
        plan.estimate(plan.Model(4, 64, 8, 8, 256, 257, 256), plan.Layout("zero9"), gpus=2)


@pytest.mark.parametrize("size", ["760m", "2.7b", "13b", "66b", "175b"])
def test_gpt3_config_comments_name_the_planners_layouts(size):
    path = REPO / f"configs/gpt3-{size}.toml"
    text = path.read_text()
    m = plan.model_from_args(parse_args(["--config", str(path)]))
    for mem in (80, 141):
        found = re.search(rf"^#\s+{mem} GB GPUs:\s+(.+)$", text, re.M)
        assert found, f"{path} has no '{mem} GB GPUs:' comment"
        assert found.group(1).strip() == plan.recommendation_line(m, mem)


# ------------------------------------------------------------ the launch scripts' plan (bench/launch_plan.py)
from megatron_cp_plugin.bench import launch_plan  # noqa: E402
from megatron_cp_plugin.megatron_lm.flags import layout_flags, megatron_lm_flags  # noqa: E402
from megatron_cp_plugin.training.config import build_parser  # noqa: E402


def _sbatch_shape(path):
    text = path.read_text()
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)", text, re.M).group(1))
    gpn = int(re.search(r"^#SBATCH --gpus-per-node=(\d+)", text, re.M).group(1))
    config = re.search(r"CONFIG=\$\{CONFIG:-([^}]+)\}", text).group(1).split()
    return nodes * gpn, config


@pytest.mark.parametrize("size", ["760m", "2.7b", "13b", "66b", "175b"])
def test_shipped_gpt3_sbatch_scripts_fit_their_gpus_with_either_trainer(size):
    gpus, config = _sbatch_shape(REPO / f"launch/gpt3-{size}.sbatch")
    for seq in (None, 65536):                      # the config's, and the docs' SEQ=65536 examples
        a = parse_args(["--config", *(str(REPO / c) for c in config)] + (["--seq-length", str(seq)] if seq else []))
        for trainer in ("plugin", "megatron-lm"):
            lay, line, err = launch_plan.choose(a, trainer, "auto", gpus, 80, 4.0, False)
            assert err is None, (size, seq, trainer, err)
            gib = float(re.fullmatch(r"plan: ([0-9.]+) GiB per GPU of 80 GiB \((.+)\)", line).group(1))
            assert gib + 4 <= 80 and line.endswith(f"({lay.name})"), line


def test_a_named_layout_that_does_not_fit_is_refused_naming_one_that_does():
    a = parse_args(["--config", str(REPO / "configs/gpt3-13b.toml"), "--seq-length", "65536"])
    lay, line, err = launch_plan.choose(a, "plugin", "zero1", 16, 80, 4.0, False)
    assert line == "plan: 112.0 GiB per GPU of 80 GiB (zero1)"
    assert err.startswith("launch: LAYOUT=zero1") and "fsdp-optim_grads fits (LAYOUT=auto picks it)" in err
    assert launch_plan.choose(a, "plugin", "zero1", 16, 80, 4.0, True)[2] is None          # PLAN_FORCE=1
    # what the configs say (zero1) does not fit either; auto does
    assert launch_plan.choose(a, "plugin", "config", 16, 80, 4.0, False)[2] is not None
    lay, line, err = launch_plan.choose(a, "plugin", "auto", 16, 80, 4.0, False)
    assert err is None and lay.name == "fsdp-optim_grads"
    with pytest.raises(ValueError, match="LAYOUT 'zero3'"):
        launch_plan.choose(a, "plugin", "zero3", 16, 80, 4.0, False)
    with pytest.raises(ValueError, match="LAYOUT 'pp2-zero1'"):          # no pipeline stages in the plugin trainer
        launch_plan.choose(a, "plugin", "pp2-zero1", 16, 80, 4.0, False)


def test_auto_keeps_what_the_flags_force():
    base = ["--config", str(REPO / "configs/gpt3-760m.toml")]
    lay = launch_plan.choose(parse_args(base), "plugin", "auto", 16, 80, 4.0, False)[0]
    assert lay.name == "zero1"
    lay = launch_plan.choose(parse_args(base + ["--recompute-granularity", "full"]), "plugin", "auto", 16, 80, 4.0,
                             False)[0]
    assert lay.name == "zero1 +recompute"                  # the flag stays, so the plan must count it
    lay = launch_plan.choose(parse_args(base + ["--use-megatron-fsdp"]), "plugin", "auto", 16, 80, 4.0, False)[0]
    assert lay.name == "fsdp-optim_grads_params"
    assert launch_plan.layout_args(lay) == ["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                                            "optim_grads_params"]


def test_megatron_lm_flags_of_the_planners_layouts():
    a = parse_args(["--config", str(REPO / "configs/gpt3-13b.toml")])
    flags = megatron_lm_flags(a, build_parser(), world_size=16, layout="pp4-zero1 +recompute")
    i = flags.index
    assert flags[i("--pipeline-model-parallel-size") + 1] == "4" and flags[i("--context-parallel-size") + 1] == "4"
    assert flags[i("--recompute-granularity") + 1] == "full" and "--use-megatron-fsdp" not in flags
    assert layout_flags(a, "fsdp-optim_grads")[:3] == ["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                                                       "optim_grads"]
    with pytest.raises(ValueError, match="--layout pp2-fsdp"):
        layout_flags(a, "pp2-fsdp")
