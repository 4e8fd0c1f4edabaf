"""cost/compute.py: the cost model's per-algorithm compute factors from `megatron-cp-bench rank` (issue 26), and
`cost-model --table step` (bench/cost_step.py)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_cp_plugin.bench import cost_step
from megatron_cp_plugin.bench.rank_replay import fit
from megatron_cp_plugin.cost import HARDWARE, Problem, predict
from megatron_cp_plugin.cost import compute as cost_compute

# Links free: a prediction is then the rank's compute alone.
FREE = dataclasses.replace(HARDWARE["h200-nvlink"], intra_bw=1e30, inter_bw=1e30, intra_lat=0.0, inter_lat=0.0)


@pytest.fixture
def fit_file(tmp_path, monkeypatch):
    def write(factors):
        p = tmp_path / "rank_compute.json"
        p.write_text(json.dumps({"factors": factors}))
        monkeypatch.setattr(cost_compute, "FIT_PATH", p)
        cost_compute.load.cache_clear()
    yield write
    cost_compute.load.cache_clear()


def test_shipped_factors_are_what_predict_uses():
    """The shipped rank_compute.json's factor scales each algorithm's compute (FREE: compute only); without one
    (an empty fit, or an algorithm it does not list) the analytic compute, factor 1.0."""
    cost_compute.load.cache_clear()
    shipped = cost_compute.load()
    pb = Problem(131072, 4, 32, 8)
    for algo in ("ring", "burst", "attention2d-no", "attention2d-o"):
        x = cost_compute.factor(algo, 4, (2, 2))
        listed = any(k == algo or k.startswith(algo + " ") for k in shipped)
        assert (x == 1.0) if not listed else (0.5 < x < 4.0), (algo, x)
        with cost_compute.disabled():
            ref = predict(algo, pb, FREE)
        assert predict(algo, pb, FREE).total_s == pytest.approx(x * ref.total_s, rel=1e-9)


def test_factors_scale_compute_only(fit_file):
    fit_file({"ring": {"4": 2.0, "16": 1.5}, "attention2d-no 2x2": {"4": 3.0}, "attention2d-no": {"4": 1.25}})
    pb = Problem(131072, 4, 32)
    for algo, x in (("ring", 2.0), ("attention2d-no", 3.0), ("attention2d-o", 1.0), ("burst", 1.0)):
        with cost_compute.disabled():
            ref = predict(algo, pb, FREE)
        got = predict(algo, pb, FREE)
        assert got.total_s == pytest.approx(x * ref.total_s, rel=1e-9)
        assert (got.fwd_bytes, got.bwd_bytes) == (ref.fwd_bytes, ref.bwd_bytes)
    # nearest measured P in log2, ties to the smaller; a grid without its own entry takes the algorithm's
    assert [cost_compute.factor("ring", P) for P in (2, 8, 9, 64)] == [2.0, 2.0, 1.5, 1.5]
    assert cost_compute.factor("attention2d-no", 4, (4, 1)) == 1.25
    # with slow links the communication is not scaled: ring's time grows by less than its compute
    slow = HARDWARE["h200-sockets"]
    with cost_compute.disabled():
        ref = predict("ring", pb, slow).total_s
    assert ref < predict("ring", pb, slow).total_s < 2 * ref


def test_bad_fit_file_names_the_entry(fit_file):
    fit_file({"ring": {"4": -1}})
    with pytest.raises(ValueError, match=r"factors\['ring'\]\['4'\] must be a positive number"):
        cost_compute.factor("ring", 4)


def test_benchmark_rows_fit_the_factors(fit_file):
    rows = [{"algo": "ring", "grid": "-", "P": 4, "x_model": 1.2}, {"algo": "ring", "grid": "-", "P": 4, "x_model": 1.4},
            {"algo": "attention2d-no", "grid": "2x2", "P": 4, "x_model": 1.5},
            {"algo": "attention2d-no", "grid": "4x1", "P": 4, "x_model": 2.5}, {"algo": "burst", "P": 4, "grid": "-"}]
    got = fit(rows, "cmd", "dev")["factors"]
    assert got == {"ring": {"4": pytest.approx(1.3)}, "attention2d-no 2x2": {"4": 1.5}, "attention2d-no": {"4": 1.5},
                   "attention2d-no 4x1": {"4": 2.5}}
    fit_file(got)
    assert cost_compute.factor("attention2d-no", 4, (4, 1)) == 2.5 and cost_compute.factor("ring", 16) == pytest.approx(1.3)


def test_step_table_against_the_measured_step(fit_file):
    fit_file({})
    rows = {(r["compute"], r["algo"]): r for r in cost_step.step_rows()}
    assert len(rows) == 6
    for c in ("fit", "analytic"):
        ring = rows[c, "ring"]
        assert ring["pred step s"] == pytest.approx(ring["meas step s"]) and ring["pred MFU"] == pytest.approx(0.388)
    assert rows["fit", "attention2d-no"]["meas / ring"] == pytest.approx(0.388 / 0.354)
    before = rows["fit", "attention2d-no"]["pred / ring"]
    fit_file({"attention2d-no": {"4": 1.2}})
    after = {(r["compute"], r["algo"]): r for r in cost_step.step_rows()}
    assert after["fit", "attention2d-no"]["pred / ring"] > before
    assert after["analytic", "attention2d-no"]["pred / ring"] == pytest.approx(before)
