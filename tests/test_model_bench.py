"""megatron-cp-bench model on CPU processes: the loss difference from CP = 1 appears only when a CP = 1 run
exists."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _bench(tmp_path, name, *flags):
    out = tmp_path / name
    r = subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_cp_plugin.bench", "model", "--nproc", "2",
                        "--algos", "ring", "--out", str(out), "--config", str(REPO / "configs/tiny.toml"),
                        "--train-iters", "3", *flags], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return {row["run"]: row for row in json.loads((out.parent / (out.name + ".json")).read_text())["rows"]}


def test_loss_difference_only_against_a_cp1_run(tmp_path, monkeypatch):
    rows = _bench(tmp_path, "with")
    assert set(rows) == {"CP=1", "ring"}
    assert "max_loss_diff_vs_cp1" not in rows["CP=1"]
    assert 0 <= rows["ring"]["max_loss_diff_vs_cp1"] <= 1e-4       # fp32 on CPU: CP = 2 repeats CP = 1

    # --no-cp1: the same report from the same run records, with no CP = 1 run and no difference column (the
    # runs are replayed here instead of trained again).
    from megatron_cp_plugin.bench import model
    records = {name: json.loads((tmp_path / f"with_{name}.json").read_text()) for name in ("cp1", "ring")}
    calls = []

    def replay(nproc, flags, out_json):
        calls.append(nproc)
        return records["cp1" if nproc == 1 else "ring"]
    monkeypatch.setattr(model, "_run", replay)
    out = tmp_path / "without"
    assert model.main(["--nproc", "2", "--algos", "ring", "--out", str(out), "--no-cp1"]) == 0
    rows = {row["run"]: row for row in json.loads((tmp_path / "without.json").read_text())["rows"]}
    assert calls == [2] and set(rows) == {"ring"} and "max_loss_diff_vs_cp1" not in rows["ring"]
    assert rows["ring"]["final_loss"] > 0
    assert "max_loss_diff" not in (tmp_path / "without.md").read_text()
