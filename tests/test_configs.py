"""configs/*.toml and megatron-cp-pretrain's --config, recompute and --result-json (CPU processes)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_cp_plugin import pretrain

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"

# Attention2D Table 3: layers, heads, head dim, hidden
GPT3 = {"760m": (24, 16, 96, 1536), "2.7b": (32, 32, 80, 2560), "13b": (40, 40, 128, 5120),
        "66b": (64, 72, 128, 9216), "175b": (96, 96, 128, 12288)}


def _parse(*argv):
    return pretrain.parse_args([str(a) for a in argv])


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_every_config_file_parses():
    files = sorted(CONFIGS.rglob("*.toml"))
    assert len(files) >= 5 + 4 + 1                     # GPT-3 sizes, algorithms, tiny
    for f in files:
        args = _parse("--config", f)
        assert args.config == [str(f)]


@pytest.mark.parametrize("size", sorted(GPT3))
def test_gpt3_configs_give_table3_dims_and_the_papers_run_settings(size):
    layers, heads, head_dim, hidden = GPT3[size]
    args = _parse("--config", CONFIGS / f"gpt3-{size}.toml", CONFIGS / "algo/attention2d-o.toml")
    args.context_parallel_size = 64                    # what _validate sets from the ranks: all GPUs in CP
    cfg = pretrain.transformer_config(args, gpu=False)  # a config only: no 175B model is built
    assert (cfg.num_layers, cfg.num_attention_heads, cfg.kv_channels, cfg.hidden_size) == (layers, heads, head_dim,
                                                                                           hidden)
    assert cfg.ffn_hidden_size == 4 * hidden and cfg.num_query_groups == heads
    assert cfg.bf16 and args.use_distributed_optimizer and cfg.tensor_model_parallel_size == 1
    assert cfg.recompute_granularity is None           # the paper: no layer-wise checkpointing by default
    assert args.context_parallel_algo == "attention2d-o"


def test_13b_long_sequences_get_full_layerwise_recompute():
    args = _parse("--config", CONFIGS / "gpt3-13b.toml", CONFIGS / "recompute-full.toml")
    args.context_parallel_size = 16
    cfg = pretrain.transformer_config(args, gpu=False)
    assert (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == ("full", "uniform", 1)


def test_66b_stage_override_keeps_the_dims():
    args = _parse("--config", CONFIGS / "gpt3-66b.toml", CONFIGS / "gpt3-66b-stage.toml")
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (8, 9216, 72)


def test_override_order_file_then_later_file_then_command_line(tmp_path):
    a = _write(tmp_path, "a.toml", 'num-layers = 3\nhidden-size = 32\nlr = 5e-4\ncontext-parallel-algo = "burst"\n')
    b = _write(tmp_path, "b.toml", "num-layers = 5\nbf16 = true\ndata-path = ['x', 'y']\n")
    args = _parse("--config", a, b)
    assert (args.num_layers, args.hidden_size, args.lr, args.bf16) == (5, 32, 5e-4, True)
    assert args.context_parallel_algo == "burst" and args.data_path == ["x", "y"]
    args = _parse("--num-layers", "7", "--config", a, b, "--context-parallel-algo", "ring")
    assert (args.num_layers, args.hidden_size, args.context_parallel_algo) == (7, 32, "ring")
    args = _parse("--config", b, a)                    # order of the files is what counts
    assert args.num_layers == 3
    assert _parse().num_layers == 2                    # no file: the parser's own defaults


@pytest.mark.parametrize("text,needles", [
    ("num_layers = 3\n", ["num_layers", "unknown key", "num-layers"]),   # underscores: a hint
    ("not-a-flag = 1\n", ["not-a-flag", "unknown key"]),
    ("config = 'other.toml'\n", ["config", "unknown key"]),
    ("num-layers = 'many'\n", ["num-layers", "not a valid int"]),
    ("num-layers = 2.5\n", ["num-layers", "not a valid int"]),
    ("bf16 = 1\n", ["bf16", "true or false"]),
    ("seq-length = true\n", ["seq-length", "takes a value"]),
    ("context-parallel-algo = 'nope'\n", ["context-parallel-algo", "must be one of"]),
    ("[model]\nnum-layers = 3\n", ["model", "tables"]),
    ("num-layers = \n", ["not valid TOML"]),
])
def test_bad_config_files_fail_naming_the_key_and_file(tmp_path, capsys, text, needles):
    bad = _write(tmp_path, "bad.toml", text)
    with pytest.raises(SystemExit) as e:
        _parse("--config", CONFIGS / "tiny.toml", bad)
    err = capsys.readouterr().err
    assert e.value.code == 2 and str(bad) in err, err
    for needle in needles:
        assert needle in err, err


def test_missing_config_file_is_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _parse("--config", tmp_path / "nope.toml")
    assert "nope.toml" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ runs
def _run(tmp_path, name, *flags, nproc, configs=("tiny.toml",)):
    out = tmp_path / f"{name}.json"
    r = subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_cp_plugin.pretrain", "--config",
                        *(str(CONFIGS / c) for c in configs), "--train-iters", "4", "--nproc", str(nproc),
                        "--result-json", str(out), *flags], capture_output=True, text=True, timeout=300, cwd=REPO)
    result = json.loads(out.read_text()) if out.exists() else None
    return r, result


def test_recompute_on_cpu_gives_the_cp1_losses_and_result_json_records_the_run(tmp_path):
    r, base = _run(tmp_path, "cp1", nproc=1)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = {"full": (["--context-parallel-algo", "attention2d-o"], ("tiny.toml", "recompute-full.toml")),
            "selective": (["--recompute-activations", "--context-parallel-algo", "ring"], ("tiny.toml",))}
    for name, (flags, configs) in runs.items():
        r, res = _run(tmp_path, name, *flags, nproc=2, configs=configs)
        assert r.returncode == 0, r.stderr[-3000:]
        assert res["status"] == "ok" and res["exit_code"] == 0 and res["error"] is None
        assert res["recompute"]["recompute_granularity"] == name
        assert res["cp_size"] == 2 and res["world_size"] == 2 and res["nodes"] == 1
        # What ran: 2 ranks on 2 GPUs are NCCL on a GPU each even with MCP_SHARE_GPU=1 (conftest sets it on GPU
        # machines); on 1 GPU they share it over gloo; on CPUs, gloo and no GPU.
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        assert res["gpus"] == min(2, gpus) and res["shared_gpu"] == (gpus == 1), res
        assert res["backend"] == ("nccl" if gpus >= 2 else "gloo"), res
        assert res["iterations"] == [1, 2, 3, 4] and len(res["step_times_s"]) == 4
        assert max(abs(a - b) for a, b in zip(res["losses"], base["losses"])) <= 1e-4, (res["losses"], base["losses"])
    assert base["cp_size"] == 1 and base["recompute"] is None
    assert (base["num_layers"], base["hidden_size"], base["num_attention_heads"], base["head_dim"]) == (2, 64, 8, 8)
    assert base["seq_length"] == 256 and base["global_batch_size"] == 2
    assert base["step_time_median_s"] > 0 and base["step_time_timed_iterations"] == 3
    assert base["tokens_per_s"] == pytest.approx(2 * 256 / base["step_time_median_s"])
    assert base["final_loss"] == base["losses"][-1]


def test_shipped_configs_are_reachable_by_name_from_anywhere(tmp_path, monkeypatch):
    from megatron_cp_plugin.pretrain import parse_args
    from megatron_cp_plugin.training.config import CONFIG_DIR, resolve_config

    monkeypatch.chdir(tmp_path)                                   # not the repository root
    a = parse_args(["--config", "gpt3-13b", "algo/ring.toml"])
    assert (a.num_layers, a.hidden_size, a.context_parallel_algo) == (40, 5120, "ring")
    assert resolve_config("configs/tiny.toml") == str(CONFIG_DIR / "tiny.toml")
    (tmp_path / "tiny.toml").write_text("num-layers = 3\n")      # a file of the user's wins over a shipped name
    assert parse_args(["--config", "tiny.toml"]).num_layers == 3


def test_configs_ship_in_the_wheel(tmp_path):
    import subprocess
    import sys
    import zipfile

    repo = __import__("pathlib").Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(repo)], check=True, capture_output=True, timeout=600)
    names = zipfile.ZipFile(next(tmp_path.glob("*.whl"))).namelist()
    assert "megatron_cp_plugin/configs/gpt3-175b.toml" in names and "megatron_cp_plugin/configs/algo/ring.toml" in names
    assert {n for n in names if n.endswith(".patch")} == {f"megatron_cp_plugin/megatron_lm/patches/{p.name}"
                                                           for p in (repo / "patches").glob("*.patch")}
