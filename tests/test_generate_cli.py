"""megatron-cp-generate: --config, the checkpoint's own model arguments (a disagreeing flag is named), the
report (prefill, per-token latency, tokens/s, bandwidth floor); the decode bench's model mode on gloo."""
from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from megatron_cp_plugin.inference.checkpoint import MODEL_ARGS, apply_model_args, set_unless_given

TINY = {"num-layers": 2, "hidden-size": 64, "num-attention-heads": 8, "num-query-groups": 2}
DEFAULTS = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 8, "num_query_groups": None,
            "ffn_hidden_size": None, "vocab_size": None}


def _ns(**kw):
    return types.SimpleNamespace(**{**{k: None for k in MODEL_ARGS}, **kw})


def test_recorded_model_args_fill_every_flag_and_a_disagreeing_flag_is_named():
    ckpt = {"num_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 2,
            "ffn_hidden_size": 256, "vocab_size": 300}
    args = _ns()
    apply_model_args(args, ckpt, set(), DEFAULTS)
    assert {k: getattr(args, k) for k in MODEL_ARGS} == ckpt
    args = _ns(hidden_size=128, num_layers=5)                   # hidden agrees, layers does not
    with pytest.raises(ValueError, match="--num-layers 5 does not match the checkpoint's 4"):
        apply_model_args(args, ckpt, {"hidden_size", "num_layers"}, DEFAULTS)


def test_help_lists_what_generation_uses_and_training_flags_still_parse(capsys):
    from megatron_cp_plugin.inference.cli import _args

    with pytest.raises(SystemExit):
        _args(["--help"])
    out = capsys.readouterr().out
    assert "--max-new-tokens" in out and "--num-layers" in out and "--context-parallel-algo" in out
    assert "--lr" not in out and "--train-iters" not in out and "--save-interval" not in out
    assert len(out.splitlines()) < 130                            # 202 lines when it listed the training flags
    args = _args(["--prompt", "x", "--lr", "0.5", "--train-iters", "3"])   # a training --config sets these
    assert (args.lr, args.train_iters, args.context_parallel_algo) == (0.5, 3, "attention2d")


def test_inferred_shapes_check_the_head_flags_against_the_qkv_rows():
    inferred = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 256, "vocab_size": 257, "_qkv_rows": 96}
    args = _ns(num_attention_heads=8, num_query_groups=2)        # (8 + 2 * 2) * 8 = 96 rows
    apply_model_args(args, inferred, {"num_attention_heads", "num_query_groups"}, DEFAULTS)
    assert (args.num_layers, args.ffn_hidden_size, args.vocab_size) == (2, 256, 257)
    with pytest.raises(ValueError, match="--num-attention-heads 8 / --num-query-groups None"):
        apply_model_args(_ns(), inferred, set(), DEFAULTS)      # MHA defaults give 192 rows
    args = _ns(num_layers=3)
    set_unless_given(args, {"num_layers"}, DEFAULTS)
    assert args.num_layers == 3 and args.hidden_size == 64


def _run(*cmd, timeout=300):
    return subprocess.run([sys.executable, "-W", "ignore", "-m", *cmd], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen")
    flags = [x for k, v in TINY.items() for x in (f"--{k}", str(v))]
    r = _run("megatron_cp_plugin.pretrain", "--nproc", "1", *flags, "--seq-length", "64", "--train-iters", "1",
             "--save", str(d / "ckpt"), "--context-parallel-algo", "ring")
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = d / "model.toml"
    cfg.write_text("".join(f"{k} = {v}\n" for k, v in TINY.items() if "heads" in k or "groups" in k)
                   + "max-new-tokens = 5\ncontext-parallel-algo = \"ring\"\n")
    return d


def test_generate_reads_config_and_checkpoint_and_reports_the_floor(checkpoint):
    out = checkpoint / "result.json"
    r = _run("megatron_cp_plugin.inference.cli", "--nproc", "2", "--config", str(checkpoint / "model.toml"),
             "--load", str(checkpoint / "ckpt"), "--prompt-ids", "1,2,3,4,5,6,7", "--batch-size", "2",
             "--result-json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    for needle in ("prefill ", "per-token latency: median", "tokens/s (batch 2)", "bandwidth floor"):
        assert needle in r.stdout, r.stdout
    res = json.loads(out.read_text())
    assert len(res["tokens"]) == 2 and res["tokens"][0] == res["tokens"][1] and len(res["tokens"][0]) == 5
    assert res["world"] == 2 and res["graphed"] is False and len(res["token_ms"]) == 4
    # CP = 1 reads the same torch_dist checkpoint and gives the same tokens (Megatron-FSDP's fsdp_dtensor
    # checkpoints: tests/test_checkpoint.py).
    r = _run("megatron_cp_plugin.inference.cli", "--nproc", "1", "--config", str(checkpoint / "model.toml"),
             "--load", str(checkpoint / "ckpt"), "--prompt-ids", "1,2,3,4,5,6,7", "--batch-size", "2",
             "--result-json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(out.read_text())["tokens"] == res["tokens"]


def test_generate_names_a_model_flag_that_disagrees_with_the_checkpoint(checkpoint):
    r = _run("megatron_cp_plugin.inference.cli", "--config", str(checkpoint / "model.toml"), "--load",
             str(checkpoint / "ckpt"), "--prompt-ids", "1,2", "--hidden-size", "128", timeout=120)
    assert r.returncode != 0 and "--hidden-size 128 does not match the checkpoint's 64" in r.stderr, r.stderr[-2000:]


def test_decode_bench_model_mode_on_gloo(tmp_path):
    # The --model bench's plumbing (token check, random-K/V latency rows, report, clean exit) on CPU processes;
    # on GPUs scripts/gpu_decode_check.sh runs it with graphs at the Llama-3.1-8B shape.
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                        "megatron_cp_plugin.bench.decode", "--model",
                        "--context", "256", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                        "--head-dim", "64", "--ffn", "128", "--tokens", "4", "--eager-context", "256",
                        "--check-context", "32", "--dtype", "fp32", "--out", str(tmp_path / "dm")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((tmp_path / "dm.json").read_text())["rows"]
    assert rows[0]["ok"] is True
    lat = [x for x in rows if x["what"].startswith("latency")]
    assert {x["decoder"] for x in lat} == {"tree", "ring"} and all(x["ms_per_token"] > 0 for x in lat)


def test_a_megatron_fsdp_checkpoint_is_refused_above_tp1_before_any_process_starts(tmp_path):
    from megatron_cp_plugin.inference.checkpoint import check_loadable

    (tmp_path / "megatron_cp_plugin.json").write_text(json.dumps({"format": "fsdp_dtensor"}))
    check_loadable(str(tmp_path), 1)
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 2: a Megatron-FSDP checkpoint"):
        check_loadable(str(tmp_path), 2)
    (tmp_path / "megatron_cp_plugin.json").write_text(json.dumps({"format": "torch_dist"}))
    check_loadable(str(tmp_path), 2)                 # dist_checkpointing reshards for TP
