"""megatron-cp-generate: --config, the checkpoint's own model arguments (a disagreeing flag is named), the
report (prefill, per-token latency, tokens/s, bandwidth floor); the decode bench's model mode on gloo, its rows
that cannot run here (no graph on gloo, not enough memory) reported with a reason."""
from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
import torch

from megatron_cp_plugin.inference.checkpoint import MODEL_ARGS, apply_model_args, set_unless_given
from megatron_cp_plugin.inference.token_check import MIN_DISTINCT, variety

NEW = 32                 # greedy tokens compared: at least MIN_DISTINCT (16) of them distinct (token_check.py)
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
    # 80 steps on Megatron's mock documents (1, 2, 3, ... counting up): the model learns to count, so greedy tokens
    # after 1, ..., 7 are 8, 9, ... (60 steps gave 8-39; one step, Megatron's init, 17 distinct of 32 with cycles).
    r = _run("megatron_cp_plugin.pretrain", "--nproc", "1", *flags, "--seq-length", "64", "--train-iters", "80",
             "--save", str(d / "ckpt"), "--context-parallel-algo", "ring")
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = d / "model.toml"
    cfg.write_text("".join(f"{k} = {v}\n" for k, v in TINY.items() if "heads" in k or "groups" in k)
                   + f"max-new-tokens = {NEW}\ncontext-parallel-algo = \"ring\"\n")
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
    assert len(res["tokens"]) == 2 and res["tokens"][0] == res["tokens"][1] and len(res["tokens"][0]) == NEW
    # Graphed where each rank has a GPU (NCCL: 2 GPUs); eager on CPU and where ranks share one (gloo)
    assert res["world"] == 2 and res["graphed"] is (torch.cuda.device_count() >= 2) and len(res["token_ms"]) == NEW - 1
    # Equal tokens mean something only if they vary (the fixture's model counts up from the prompt).
    assert variety(res["tokens"]) is None, variety(res["tokens"])
    assert res["distinct_tokens"] == [len(set(res["tokens"][0]))] * 2 and res["random_weights"] is False
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


BENCH = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "64", "--ffn", "128",
         "--tokens", "32", "--check-context", "32", "--dtype", "fp32"]


def test_decode_bench_model_mode_on_gloo(tmp_path):
    # The --model bench's plumbing (token check, random-K/V latency rows, report, clean exit) on 2 gloo ranks: CPU
    # processes here; on a GPU machine (MCP_SHARE_GPU=1) ranks sharing a GPU, or NCCL where each has its own,
    # where the graph rows run. scripts/gpu_decode_check.sh runs it with graphs at the Llama-3.1-8B shape.
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                        "megatron_cp_plugin.bench.decode", "--model", *BENCH, "--context", "256",
                        "--eager-context", "256", "--out", str(tmp_path / "dm")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((tmp_path / "dm.json").read_text())["rows"]
    assert not [x for x in rows if "error" in x], rows
    tok = rows[0]
    assert tok["ok"] is True and tok["distinct"] >= MIN_DISTINCT and "why" not in tok, tok   # varied, graph == eager
    lat = [x for x in rows if x["what"].startswith("latency")]
    ran = [x for x in lat if "not_run" not in x]
    skipped = [x for x in rows if "not_run" in x]
    assert all(x["ms_per_token"] > 0 for x in ran) and {x["decoder"] for x in ran if x["mode"] == "eager"} == {
        "tree", "ring"}
    assert all(x["not_run"].startswith("not run: ") and "\n" not in x["not_run"] for x in skipped), skipped
    # Graph rows run where each rank has its own GPU (NCCL); elsewhere all three (tree at b = 1 and 8, ring at
    # b = 1) are not-run rows, and so is the graph == eager comparison, whose row comes second.
    graph_rows = [x for x in lat if x["mode"] == "graph"]
    if tok["what"] == "tokens graph == eager":
        assert not skipped
    else:
        assert tok["what"] == "tokens vary (eager)" and rows[1]["not_run"].startswith("not run: a CUDA graph")
        assert len(graph_rows) == 3 and all("not_run" in x for x in graph_rows)
    for x in (x for x in skipped if x in lat):         # each printed once: by rank 0 only
        assert r.stdout.count(f"{x['context']:>8} b={x['batch']} {x['decoder']:4s} {x['mode']:5s} not run") == 1


def _bench_rows(rank, world, argv, free):
    """decode_model's rows in-process, with `free` bytes said to be free on every rank (bench/_common.py)."""
    from megatron_cp_plugin.bench import _common
    from megatron_cp_plugin.bench.decode import parser
    from megatron_cp_plugin.bench.decode_model import model_bench

    real, _common.free_bytes = _common.free_bytes, lambda device: free
    try:
        return model_bench(parser().parse_args(argv), rank, world, torch.device("cpu"), None)
    finally:
        _common.free_bytes = real


def test_decode_bench_skips_a_configuration_that_does_not_fit_before_allocating_it(pools, tmp_path):
    # 1.5 GiB said free: the 64-token rows need ~1.05 GiB (mostly the 1 GiB margin); a million tokens' cache
    # (2 layers x 2 KV heads x 64 x fp32 x K, V = 2 KiB a token: 2 GiB) is refused with its reason, unallocated
    # (this machine may well have the 2 GiB: only the patched figure refuses it).
    argv = ["--model", *BENCH, "--tokens", "8", "--context", "64", "--eager-context", "64", str(1 << 20),
            "--decoders", "tree", "--out", str(tmp_path / "oom")]
    rows = pools(1).run(_bench_rows, argv, int(1.5 * 2**30))[0]
    assert not [x for x in rows if "error" in x], rows
    eager = {x["context"]: x for x in rows if x["what"].startswith("latency") and x["mode"] == "eager"}
    assert eager[64]["ms_per_token"] > 0 and "not_run" not in eager[64]
    assert "ms_per_token" not in eager[1 << 20], eager
    assert eager[1 << 20]["not_run"] == "not run: needs 3.1 GiB of 1.5 GiB free on this CPU", eager
    assert [x["mode"] for x in rows if x.get("not_run", "").startswith("not run: a CUDA graph needs a GPU")] == [
        "graph vs eager", "graph", "graph"]                                     # tree at b = 1 and 8


def test_decode_config_bytes_refuse_the_128k_batch_8_case_on_one_h200():
    # Seen on one H200 (139.8 GiB): `decode --model --context 32768 131072 --batch 1 8` at CP = 1 gave a
    # traceback row for 128k, batch 8 (OutOfMemoryError, "Tried to allocate 64.02 GiB": its K, or its V).
    from megatron_cp_plugin.bench.decode import parser
    from megatron_cp_plugin.bench.decode_model import MARGIN_BYTES, config_bytes, latency_capacity

    from megatron_cp_plugin.inference.static import StaticCache

    c = StaticCache(3, 2, 5, 2, 8, torch.bfloat16, torch.device("cpu"))  # bytes_for = what the cache allocates
    assert StaticCache.bytes_for(3, 2, 5, 2, 8, 2) == sum(x.numel() * x.element_size()
                                                          for x in (c.k, c.v, c.pos, c.fill))
    GiB = 2**30
    a = parser().parse_args(["--model"])                # the Llama-3.1-8B shape, bf16
    assert (a.layers, a.hidden, a.heads, a.kv_heads, a.head_dim, a.ffn, a.dtype) == (
        32, 4096, 32, 8, 128, 14336, "bf16")
    free = 139.8 * GiB - 10.2e9                         # the H200 less the model's 10.2 GB of weights

    def need(context, batch, world=1, decoder="tree", graphed=True):
        return config_bytes(a, batch=batch, capacity=latency_capacity(context, a.tokens, world), world=world,
                            decoder=decoder, graphed=graphed)

    # 128k x batch 8: K and V are 2 x 64.02 GiB (the failed allocation's size), 128.05 GiB with the rest.
    assert 2 * 32 * 8 * (latency_capacity(131072, 32, 1) + 1) * 8 * 128 * 2 / GiB == pytest.approx(128.04, abs=0.01)
    assert need(131072, 8) / GiB == pytest.approx(128.05 * 1.05 + 1, abs=0.05) and need(131072, 8) > free
    assert need(131072, 1) / GiB == pytest.approx(17.8, abs=0.1)
    assert need(32768, 8) / GiB == pytest.approx(34.6, abs=0.1)
    assert need(131072, 1) < free and need(32768, 8) < free and need(524288, 1, world=2) < free
    # Ring decoding adds one layer's received shard (P = 2) to the step, twice when graphed (warm-up + pool).
    shard = 32 * 8 * 128 * 2 * 2 * (latency_capacity(131072, 32, 2) + 1) / 32
    ring = need(131072, 1, world=2, decoder="ring") - need(131072, 1, world=2)
    assert ring == pytest.approx(2 * 1.05 * shard, rel=0.01)
    assert need(64, 1) > MARGIN_BYTES and need(64, 1) < MARGIN_BYTES + 2**20 * 64       # tiny: mostly the margin


def test_a_megatron_fsdp_checkpoint_is_refused_above_tp1_before_any_process_starts(tmp_path):
    from megatron_cp_plugin.inference.checkpoint import check_loadable

    (tmp_path / "megatron_cp_plugin.json").write_text(json.dumps({"format": "fsdp_dtensor"}))
    check_loadable(str(tmp_path), 1)
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 2: a Megatron-FSDP checkpoint"):
        check_loadable(str(tmp_path), 2)
    (tmp_path / "megatron_cp_plugin.json").write_text(json.dumps({"format": "torch_dist"}))
    check_loadable(str(tmp_path), 2)                 # dist_checkpointing reshards for TP
