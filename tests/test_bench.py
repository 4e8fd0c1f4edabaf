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
