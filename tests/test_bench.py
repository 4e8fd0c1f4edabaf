"""megatron-cp-bench on CPU (gloo): the attention subcommand runs every algorithm side by side and reports
unavailable anchors by name; the report files exist and carry the command; plot redraws from JSON."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_cp_plugin.bench.cli import SUBCOMMANDS, main


def test_help_and_unknown_subcommand(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in SUBCOMMANDS)
    with pytest.raises(SystemExit, match="unknown subcommand 'nope'"):
        main(["nope"])


def test_attention_side_by_side_on_gloo(tmp_path):
    stem = tmp_path / "attention"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "megatron_cp_plugin.bench", "attention", "--seq", "64", "--heads", "4", "--kv-heads", "2",
           "--head-dim", "16", "--warmup", "1", "--iters", "1", "--out", str(stem)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((tmp_path / "attention.json").read_text())
    algos = [r["algo"] for r in res["rows"]]
    for algo in ("ring", "burst", "attention2d-no", "attention2d-o"):
        row = next(r for r in res["rows"] if r["algo"] == algo)
        assert row["fwd_bwd_ms"] > 0 and row["MB_sent_fwd_bwd"] > 0
    # GQA on CPU: PyTorch's native CP cannot run and says why instead of printing a number.
    assert any(a.startswith("torch-cp-") and "not run" in a for a in algos)
    import torch
    assert "attention" in res["command"]
    assert res["device"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU")
    assert (tmp_path / "attention.md").read_text().count("\n| ") >= 5
    # ring-te, the ring with TransformerEngine's byte budget, runs by default: its fwd_bwd_x_ring_te is 1 and every
    # other row's is its time over ring-te's; te-p2p runs where TransformerEngine imports on CUDA, else 'not run'.
    by = {r["algo"]: r for r in res["rows"]}
    te = by["ring-te"]
    assert te["fwd_bwd_ms"] > 0 and te["MB_sent_fwd_bwd"] > 0 and te["fwd_bwd_x_ring_te"] == 1.0
    for r in res["rows"]:
        if "fwd_bwd_ms" in r:
            assert r["fwd_bwd_x_ring_te"] == pytest.approx(r["fwd_bwd_ms"] / te["fwd_bwd_ms"])
    # ring-te sends dK, dV in the input dtype, ring in fp32: on CPU (fp32 inputs) the bytes are equal.
    assert te["MB_sent_fwd_bwd"] <= by["ring"]["MB_sent_fwd_bwd"]
    assert "| fwd_bwd_x_torch_cp | fwd_bwd_x_ring_te |" in (tmp_path / "attention.md").read_text().splitlines()[2]
    if "te-p2p" not in by:
        assert any(a.startswith("te-p2p (not run:") for a in by)
        assert proc.stderr.count("te-p2p anchor not run") == 1
    pytest.importorskip("matplotlib")
    (tmp_path / "attention.png").unlink(missing_ok=True)
    assert main(["plot", str(tmp_path / "attention.json")]) == 0
    assert (tmp_path / "attention.png").stat().st_size > 1000


# ------------------------------------------------------------------------------------ memory: not-run rows
GiB = 2**30
MHA32 = dict(h=32, hk=32, d=128, elem=2)                         # bf16, 32 heads of 128


def test_attention_need_arithmetic():
    from megatron_cp_plugin.algos import registry
    from megatron_cp_plugin.bench.cp_attention import MARGIN, attention_need, input_bytes

    # One device, 1M tokens: q, k, v, dO 32 GiB + o, dq, dk, dv 32 + cuDNN's fp32 dQ accumulator 16 > 80 GiB.
    one = input_bytes(2**20, **MHA32) + attention_need("single", 2**20, 1, **MHA32)
    assert 85 * GiB < one < 90 * GiB
    # 128k over P = 4: every algorithm, baseline and anchor fits an 80 GiB card (allgather's, the largest
    # of ours, 22 GiB with the 4 GiB of full inputs; torch CP's 31 GiB).
    names = list(registry.names(baselines=True)) + ["torch-cp-allgather-cudnn", "te-p2p", "ring-flash-attn"]
    for name in names:
        assert input_bytes(2**17, **MHA32) + attention_need(name, 2**17, 4, **MHA32) < 32 * GiB, name
    # The worked number of the ring at 128k, P = 4 (U = 256 MiB, one bf16 q shard; L = its 4 MiB of fp32 lse):
    # shards 4U + saved o 1U + L + the backward's dq acc 2U, K, V in flight 4U, dK, dV acc 12U, the last and
    # this block's dq, dk, dv 6U, cuDNN's dQ accumulator 2U, times 1.15.
    U, L = 2**28, 32 * 2**15 * 4
    assert attention_need("ring", 2**17, 4, **MHA32) == pytest.approx(MARGIN * (31 * U + L))
    # 1M tokens over P = 8 (one H200 node): ring fits 141 GiB, allgather (the gathered 16 GiB of K, V, the
    # fp32 partials of every owner and their reduction) does not.
    at8 = {n: input_bytes(2**20, **MHA32) + attention_need(n, 2**20, 8, **MHA32) for n in ("ring", "allgather")}
    assert at8["ring"] < 80 * GiB < 141 * GiB < at8["allgather"]
    # GQA shrinks what K, V cost; packed rows add their reordered copies.
    gqa = dict(MHA32, hk=8)
    assert attention_need("ring", 2**17, 4, **gqa) < attention_need("ring", 2**17, 4, **MHA32)
    assert attention_need("ring", 2**17, 4, **MHA32, packed=True) > attention_need("ring", 2**17, 4, **MHA32)
    with pytest.raises(ValueError, match="no memory model"):
        attention_need("nope", 2**17, 4, **MHA32)


def _attention_with_free(rank, world, stem, free):
    """cp_attention.bench on this pool rank with `free[rank]` bytes free on its device (patched)."""
    import torch

    from megatron_cp_plugin.bench import _common, cp_attention

    saved = _common.free_bytes
    _common.free_bytes = lambda device: free[rank]
    try:
        a = cp_attention.parser().parse_args(
            ["--seq", "64", "1024", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--warmup", "0",
             "--iters", "1", "--algos", "ring", "attention2d-no", "--anchors", "--out", stem])
        return cp_attention.bench(a, rank, world, torch.device("cpu"))
    finally:
        _common.free_bytes = saved


def test_attention_too_big_configurations_are_not_run_rows(pools, tmp_path):
    """A configuration needing more than a rank has free is a not-run row on every rank (rank 1 has less free
    memory than rank 0 here: both skip it, neither waits for the other), the others run, and the report keeps it."""
    from megatron_cp_plugin.bench.cp_attention import attention_need, input_bytes

    shape = dict(h=4, hk=2, d=16, elem=4)                            # fp32 on CPU
    ring, a2d = (attention_need(n, 1024, 2, **shape) for n in ("ring", "attention2d-no"))
    assert attention_need("single", 1024, 1, **shape) < ring < a2d   # so that ring fits and attention2d-no not
    small = (ring + a2d) / 2
    assert input_bytes(1024, **shape) < small
    stem = str(tmp_path / "attention")
    rows = pools(2).run(_attention_with_free, stem, [100 * GiB, small], timeout=240)[0]
    by = {(r["S"], r["algo"]): r for r in rows}
    for key in [(64, "ring"), (64, "attention2d-no"), (1024, "ring")]:
        assert by[key]["fwd_bwd_ms"] > 0 and "not_run" not in by[key], key
    assert any(s == 1024 and a.startswith("single-GPU") and "fwd_bwd_ms" in r for (s, a), r in by.items())
    skipped = by[(1024, "attention2d-no")]
    assert "fwd_bwd_ms" not in skipped and skipped["not_run"].startswith("not run: needs ")
    assert f"of {small / GiB:.1f} GiB free on this CPU" in skipped["not_run"]
    res = json.loads((tmp_path / "attention.json").read_text())
    assert [r.get("not_run") for r in res["rows"]] == [r.get("not_run") for r in rows]
    md = (tmp_path / "attention.md").read_text().splitlines()
    assert md[2].endswith("| not_run |") and sum("not run: needs" in line for line in md) == 1


def test_profile_attention_splits_each_ranks_time():
    """scripts/profile_attention.py: the interval arithmetic of its per-stream split (a kernel list made up here: a
    compute stream busy 0-4 and 6-10 us, NCCL 3-7 us beside it), then two gloo CPU ranks profiling ring and
    Attention2D-NO (a table each per rank; PyTorch's native CP, CUDA only, says why it did not run). On a GPU the
    script runs in scripts/gpu_ring_te_bench_check.sh's step D (2 GPUs, NCCL)."""
    import importlib.util
    import os
    import tempfile
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "profile_attention.py")
    spec = importlib.util.spec_from_file_location("profile_attention", script)
    pa = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pa)
    kernels = [("flash_fwd", 7, 0.0, 3.0), ("add", 7, 2.0, 4.0), ("flash_bwd", 9, 6.0, 10.0),
               ("ncclDevKernel_AllGather", 11, 3.0, 7.0)]
    r = pa.summarize(kernels, iters=1, wall_ms=0.012)
    assert r["compute_ms"] == pytest.approx(0.008) and r["idle_ms"] == pytest.approx(0.004)
    assert r["nccl_ms"] == pytest.approx(0.004) and r["nccl_beside_compute_ms"] == pytest.approx(0.002)
    assert r["streams"] == {"7": pytest.approx(0.004), "9": pytest.approx(0.004), "nccl": pytest.approx(0.004)}
    assert pa.covered([(0, 10)], [(2, 3), (2.5, 4), (9, 12)]) == pytest.approx(3.0)
    with tempfile.TemporaryDirectory() as out:
        r = subprocess.run([sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node", "2", script, "--seq", "256", "--heads", "2", "--head-dim", "16",
                            "--iters", "1", "--algos", "ring", "attention2d-no", "torch-cp-allgather-cudnn",
                            "--out", out], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))       # CPU ranks on a GPU machine too
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        for rank in (0, 1):
            text = open(os.path.join(out, f"profile_attention_r{rank}.txt")).read()
            assert f"ring rank {rank}: wall" in text and f"attention2d-no rank {rank}: wall" in text, text
            assert "aten::" in text and "torch-cp-allgather-cudnn: not run" in text
