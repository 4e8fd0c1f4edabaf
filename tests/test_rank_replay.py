"""`megatron-cp-bench rank` (bench/rank_cli.py, replaying with bench/rank_replay.py): one rank's local work
replayed in one process is that rank's real work. On a gloo group of 4, every rank runs every algorithm (ring,
ring-te, burst, attention2d-no / -o on the square 2 x 2 and the rectangular 4 x 1 and 1 x 4 grids) with its
receives recorded; replaying its receives in the same process, without torch.distributed, must give the same output
and gradients bit for bit. The subcommand runs on CPU at a tiny size and reports launches for every algorithm."""
from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.distributed as dist

import megatron_cp_plugin as mcp
from megatron_cp_plugin.bench._replay_comm import Recorder, patched
from megatron_cp_plugin.cp_grid import get_grid
from megatron_cp_plugin.bench.cli import main as bench_main
from megatron_cp_plugin.bench.rank_replay import ALGOS, GRID_ALGOS, RankReplay

CONFIGS = [(a, None) for a in ALGOS if a not in GRID_ALGOS] + [
    (a, g) for a in GRID_ALGOS for g in ((2, 2), (4, 1), (1, 4))]


@pytest.fixture(autouse=True)
def _attention2d_o_own_schedule(monkeypatch):
    """Attention2D-O's own schedule at these tests' shards of tens of tokens (cp_grid.overlap_pays would run -NO's)."""
    from megatron_cp_plugin import cp_grid
    monkeypatch.setattr(cp_grid, "OVERLAP_MIN_LOCAL", 0)


def _record_then_replay(rank, world, dtype):
    """For every config: the real distributed fwd+bwd with its receives recorded, then the replay of this rank
    fed with them; returns the configs whose replay differs, and how."""
    g = torch.Generator().manual_seed(5)
    seq, h, hk, d = 2 * world * 6, 4, 2, 16
    full = [torch.randn(1, seq, n, d, generator=g, dtype=dtype) for n in (h, hk, hk, h)]
    bad = []
    for algo, grid in CONFIGS:
        q, k, v, do = (mcp.shard_sequence(t, algo=algo).contiguous() for t in full)
        group = get_grid(dist.group.WORLD, grid) if grid else dist.group.WORLD     # built once per pool
        rec = Recorder()
        ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
        with patched(rec):
            o = ALGOS[algo](ql, kl, vl, group=group, causal=True, softmax_scale=d ** -0.5, backend=None,
                            comm_stats=None, packing=None)
            real = (o.detach(),) + torch.autograd.grad(o, (ql, kl, vl), do)
        assert all(t is not None for t in rec.source)
        rep = RankReplay(algo, world, rank, q, k, v, do, grid=grid, source=rec.source)
        got = rep()
        for name, x, y in zip(("o", "dq", "dk", "dv"), got, real):
            if not torch.equal(x, y):
                bad.append(f"{algo} {grid} rank {rank} {dtype}: {name} differs by {(x - y).abs().max().item():.3g}")
        if rep.d.cursor != len(rec.source):
            bad.append(f"{algo} {grid} rank {rank}: replay used {rep.d.cursor} of {len(rec.source)} receives")
    return bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_is_the_ranks_real_work(pools, dtype):
    bad = sum(pools(4).run(_record_then_replay, dtype), [])
    assert not bad, "\n".join(bad)


def test_rank_subcommand_reports_every_algorithm(tmp_path, capsys, monkeypatch):
    stem = tmp_path / "rank"
    monkeypatch.setattr(sys, "argv", ["megatron-cp-bench", "rank"])     # what the report records as its command
    assert bench_main(["rank", "--seq-len", "64", "--cp", "4", "--heads", "4", "--kv-heads", "4", "2",
                       "--head-dim", "16", "--iters", "1", "--budget-s", "0", "--out", str(stem)]) == 0
    assert "| x_ideal |" in capsys.readouterr().out
    res = json.loads((tmp_path / "rank.json").read_text())
    rows = res["rows"]
    seen = {(r["algo"], r["grid"], r["h/h_kv"]) for r in rows}
    for hk in ("4/4", "4/2"):
        for algo in ("ring", "ring-te", "burst", "allgather"):
            assert (algo, "-", hk) in seen
        for algo in GRID_ALGOS:
            assert {(algo, "2x2", hk), (algo, "4x1", hk)} <= seen
    for r in rows:
        assert r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["x_ideal"] > 0 and 0 <= r["rank"] < 4
        assert r["ideal_drift"] > 0                           # the ideal re-timed after the rows of its length
        assert (r["passes"], r["spread"], r["iters"]) == (1, 0, 1)      # --budget-s 0: one pass (the test below)
        ring = next(x for x in rows if x["algo"] == "ring" and x["h/h_kv"] == r["h/h_kv"])
        assert r["x_ring"] == pytest.approx(r["fwd_bwd_ms"] / ring["fwd_bwd_ms"]) and ring["x_ring"] == 1
        # the launches of the local work: every (Q, K) block pair of the rank is one attention call, fwd and bwd;
        # attention2d-no on the square grid gathers Q, K, V chunks that interleave into one triangle (its one call);
        # attention2d-o on 2 x 2 batches its second forward pass's 2 chunks: one call or two, by their masks
        # attention2d-no on 4 x 1 splits its own pair's backward in three calls around the dK, dV exchange (own_split)
        # ring, ring-te and burst run in rounds at 16 tokens a rank (ring.round_size: one round of 3), a pass being
        # the own triangle and up to three calls (the ranks before, the ranks after in two chunks); burst's
        # backward meets the ranks after first (with r's first key chunk) and before second, the same count
        rounds = 1 + (r["rank"] > 0) + 2 * (r["rank"] < 3)
        calls = {("attention2d-no", "2x2"): (2,), ("attention2d-no", "4x1"): (10,),
                 ("attention2d-o", "2x2"): (7, 8), ("ring", "-"): (2 * rounds,),
                 ("ring-te", "-"): (2 * rounds,), ("burst", "-"): (2 * rounds,),
                 ("allgather", "-"): (2 * rounds,)}.get((r["algo"], r["grid"]), (8,))    # allgather: its groups
        assert r["ops"] > r["attn_calls"] and r["attn_calls"] in calls, (r["algo"], r["grid"])
        assert r["copies"] > 0 and r["copy_MB"] > 0
    assert "rank" in res["command"] and (tmp_path / "rank.md").read_text().count("\n| ") == len(rows) + 1


def test_rank_subcommand_counts_launches_at_each_length(tmp_path, monkeypatch):
    """The ops and kernels of a row are counted at its own length: a call's chunks, rounds and splits depend on it.
    Attention2D-NO on 2 x 2 under a 32-token cap: 16 tokens a rank group into one call each way, 32 do not (four
    chunk pairs each way). Counted once per (algo, grid, P), the 128-token row repeated the 64-token row's 2."""
    from megatron_cp_plugin.bench import rank_cli

    monkeypatch.setattr(rank_cli, "slowest_rank", lambda *a, **kw: 1)
    assert bench_main(["rank", "--seq-len", "64", "128", "--cp", "4", "--heads", "2", "--kv-heads", "2",
                       "--head-dim", "8", "--iters", "1", "--budget-s", "0", "--algos", "attention2d-no",
                       "--grids", "square", "--group-tokens", "32", "--out", str(tmp_path / "r")]) == 0
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert {r["S"]: r["attn_calls"] for r in rows} == {64: 2, 128: 8}


def test_rank_subcommand_times_a_cells_rows_there_and_back(tmp_path, monkeypatch):
    """--passes 3: every row of a (length, heads, P) cell is timed in each pass, the passes in alternate orders (A B C,
    C B A, A B C), so that a device drifting during the cell moves every row alike; each row pools its passes'
    calls. A row whose warm-up call outlasts its share of --budget-s runs one pass (at 1M a call takes seconds: a
    second pass would double the run): with --budget-s 0, every row. (The slowest-rank search is stubbed.)"""
    from megatron_cp_plugin.bench import rank_cli

    seen, real = [], rank_cli.RankReplay

    def replay(algo, P, rank, *a, grid=None, **kw):
        seen.append((algo, grid))
        return real(algo, P, rank, *a, grid=grid, **kw)
    monkeypatch.setattr(rank_cli, "RankReplay", replay)
    monkeypatch.setattr(rank_cli, "slowest_rank", lambda *a, **kw: 1)
    cell = [("ring", None), ("burst", None), ("attention2d-no", (2, 2)), ("attention2d-no", (4, 1))]
    for budget, order, passes in (("100", cell + cell[::-1] + cell, 3), ("0", cell, 1)):
        seen.clear()
        assert bench_main(["rank", "--seq-len", "32", "--cp", "4", "--heads", "2", "--kv-heads", "2", "--head-dim",
                           "8", "--iters", "3", "--passes", "3", "--budget-s", budget, "--algos", "ring", "burst",
                           "attention2d-no", "--out", str(tmp_path / "r")]) == 0
        assert seen == order
        rows = json.loads((tmp_path / "r.json").read_text())["rows"]
        assert [(r["passes"], r["iters"]) for r in rows] == [(passes, passes)] * 4
    with pytest.raises(SystemExit):
        bench_main(["rank", "--passes", "0"])


def test_rank_subcommand_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        bench_main(["rank", "--kv-heads", "3"])
    with pytest.raises(ValueError, match="algo must be one of"):
        RankReplay("nope", 4, 0, *(torch.zeros(1, 2, 1, 8),) * 4)


def test_replay_need_arithmetic():
    """What a replayed rank needs (its buffers in a P-rank run, the prepared receives): 1M tokens, 32 heads of 128,
    bf16. The ring at P = 4 needs 77 GiB with its shards (an 80 GiB card holds it only just: --max-local keeps it
    out by default), at P = 16 a quarter of that; Attention2D-NO on a 64 x 1 grid, which gathers every K, V chunk of
    its column, 131 GiB (its dK, dV reduction sends them without a packing copy and sums them without an fp32 copy:
    150 before), on the 8 x 8 grid 28 (31 before)."""
    from megatron_cp_plugin.bench.rank_replay import replay_need, shard_bytes, single_need

    GiB = 2**30

    def total(algo, P, grid=None):
        return (shard_bytes(2**20, P, 32, 32, 128, 2) + replay_need(algo, 2**20, P, 32, 32, 128, 2, grid)) / GiB

    assert 75 < total("ring", 4) < 80 and total("ring", 16) == pytest.approx(total("ring", 4) / 4)
    assert total("attention2d-no", 64, (64, 1)) > 130 > 80 > total("attention2d-no", 64, (8, 8)) > 20
    assert total("attention2d-o", 64, (64, 1)) < total("attention2d-no", 64, (64, 1))   # rings: no gathered column
    # the one-device ideal at 256k (the default --ideal-max-seq) fits 80 GiB, at 1M not
    assert single_need(2**18, 32, 32, 128, 2) < 80 * GiB < single_need(2**20, 32, 32, 128, 2)


def test_rank_subcommand_reports_rows_that_do_not_fit_as_not_run(tmp_path, monkeypatch):
    """With less free memory than P = 2's rank needs, that row is a not-run row (before anything of it is
    allocated), P = 3's runs (the neighbour ring: below ring.ROUND_MIN_P), and so does the one-device ideal."""
    from megatron_cp_plugin.bench import _common
    from megatron_cp_plugin.bench.rank_replay import replay_need, shard_bytes, single_need

    args = (48, 4, 2, 16, 2)                       # S, h, h_kv, d, bf16
    at = {P: shard_bytes(48, P, *args[1:]) + replay_need("ring", 48, P, *args[1:]) for P in (2, 3)}
    assert max(at[3], single_need(*args)) < at[2]
    free = (max(at[3], single_need(*args)) + replay_need("ring", 48, 2, *args[1:])) / 2
    assert free < replay_need("ring", 48, 2, *args[1:])      # P = 2's shards are held when its row is checked
    monkeypatch.setattr(_common, "free_bytes", lambda device: free)
    monkeypatch.setattr(sys, "argv", ["megatron-cp-bench", "rank"])
    stem = tmp_path / "rank"
    assert bench_main(["rank", "--seq-len", "48", "--cp", "2", "3", "--heads", "4", "--kv-heads", "2",
                       "--head-dim", "16", "--iters", "1", "--budget-s", "0", "--algos", "ring",
                       "--out", str(stem)]) == 0
    rows = {r["P"]: r for r in json.loads((tmp_path / "rank.json").read_text())["rows"]}
    assert rows[3]["fwd_ms"] > 0 and rows[3]["x_ideal"] > 0 and "not_run" not in rows[3]
    assert rows[2]["not_run"].startswith("not run: needs ") and "fwd_ms" not in rows[2]
    # the report keeps the row first, its reason in the last column (after the columns of the rows that ran)
    md = (tmp_path / "rank.md").read_text().splitlines()
    assert md[2].startswith("| S | h/h_kv | P | algo | grid | rank | fwd_ms |") and md[2].endswith("| not_run |")
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "this CPU"   # the device the rows use
    assert md[4].startswith("| 48 | 4/2 | 2 | ring | - |") and md[4].endswith(f" not run: needs 0.0 GiB of 0.0 GiB "
                                                                             f"free on {where} |")


def test_refit_recomputes_the_factors_against_todays_model(tmp_path):
    """`rank --refit OUT.json --fit-out F`: the x_model of every timed row against the cost model as it is now (so a
    change to its constants keeps the committed factors relative to it); rows not run are skipped."""
    from megatron_cp_plugin.bench.rank_replay import model_x_ideal
    rows = [{"S": 131072, "h/h_kv": "32/8", "P": 16, "algo": "ring", "grid": "-", "x_ideal": 1.2},
            {"S": 1048576, "h/h_kv": "32/32", "P": 16, "algo": "ring", "grid": "-", "x_ideal": 1.0},
            {"S": 131072, "h/h_kv": "32/32", "P": 16, "algo": "attention2d-no", "grid": "4x4", "x_ideal": 1.3},
            {"S": 131072, "h/h_kv": "32/32", "P": 64, "algo": "burst", "grid": "-", "not_run": "not run: x"}]
    src = tmp_path / "rank.json"
    src.write_text(json.dumps({"header": "rank_replay: ... b=1 d=64 causal torch.bfloat16.", "command": "c",
                               "device": "GPU", "rows": rows}))
    assert bench_main(["rank", "--refit", str(src), "--fit-out", str(tmp_path / "fit.json")]) == 0
    f = json.loads((tmp_path / "fit.json").read_text())["factors"]
    want = [r["x_ideal"] / model_x_ideal(r["algo"], r["S"], r["P"], *map(int, r["h/h_kv"].split("/")), 64,
                                         (4, 4) if r["grid"] == "4x4" else None, 2) for r in rows[:3]]
    assert f["ring"]["16"] == pytest.approx((want[0] + want[1]) / 2)
    assert f["attention2d-no 4x4"]["16"] == f["attention2d-no"]["16"] == pytest.approx(want[2])
    assert set(f) == {"ring", "attention2d-no 4x4", "attention2d-no"}
    with pytest.raises(SystemExit, match="--fit-out"):
        bench_main(["rank", "--refit", str(src)])
    # Several files: their rows together (a run cut by --deadline-s, then the rows it cut); a cell timed in both
    # counts each row.
    more = [{"S": 131072, "h/h_kv": "32/8", "P": 16, "algo": "ring", "grid": "-", "x_ideal": 1.5},
            {"S": 131072, "h/h_kv": "32/32", "P": 2, "algo": "burst", "grid": "-", "x_ideal": 1.1}]
    src2 = tmp_path / "rank2.json"
    src2.write_text(json.dumps({"header": "rank_replay: ... b=1 d=64 causal torch.bfloat16.", "command": "c2",
                                "device": "GPU", "rows": more}))
    assert bench_main(["rank", "--refit", str(src), str(src2), "--fit-out", str(tmp_path / "fit2.json")]) == 0
    out = json.loads((tmp_path / "fit2.json").read_text())
    x = [r["x_ideal"] / model_x_ideal(r["algo"], r["S"], r["P"], *map(int, r["h/h_kv"].split("/")), 64, None, 2)
         for r in more]
    assert out["factors"]["ring"]["16"] == pytest.approx((want[0] + want[1] + x[0]) / 3)
    assert out["factors"]["burst"]["2"] == pytest.approx(max(1.0, x[1]))
    assert set(out["factors"]) == {"ring", "attention2d-no 4x4", "attention2d-no", "burst"}
    assert "c; c2" in out["source"] and str(src2) in out["source"]
    assert (tmp_path / "fit2.json").read_text().endswith("}\n")


def test_fit_source_is_the_command_a_user_types():
    """A fit file's `source` names the run as `megatron-cp-bench ...`, without the paths it wrote to."""
    from megatron_cp_plugin.bench.rank_replay import run_command
    argv = ["/x/megatron_cp_plugin/bench/__main__.py", "rank", "--cp", "16", "--out", "/root/out/g", "--iters", "6",
            "--fit-out", "/root/f.json", "--out=/o"]
    assert run_command(argv) == "megatron-cp-bench rank --cp 16 --iters 6"
    assert run_command(" ".join(argv)) == run_command(argv)
    assert run_command("megatron-cp-bench rank --cp 2") == "megatron-cp-bench rank --cp 2"


def _call_order(monkeypatch, module, kernels) -> list:
    """The replayed rank's events, in order: "gather" for each all_gather posted or run, "wait" for each wait on a
    posted one, and each call of `module`'s functions `kernels` by name."""
    from megatron_cp_plugin.bench import _replay_comm

    events = []

    class Work:
        def wait(self):
            events.append("wait")
            return True

    real_gather = _replay_comm.ReplayDist.all_gather

    def gather(self, out, inp, group=None, async_op=False):
        events.append("gather")
        real_gather(self, out, inp, group)
        return Work() if async_op else None

    monkeypatch.setattr(_replay_comm.ReplayDist, "all_gather", gather)
    for name in kernels:
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _n=name, **k: (events.append(_n), _real(*a, **k))[1])
    return events


@pytest.mark.parametrize("P", [2, 3, 6])
def test_allgather_computes_its_own_block_while_the_gather_runs(monkeypatch, P):
    """allgather posts its K, V gathers and computes its own block (its own K, V) before it waits for them, forward
    and backward, grouped (P = 6) and not (P = 2, 3): the order of kernel calls and waits, on a replayed rank."""
    from megatron_cp_plugin.algos import allgather
    from megatron_cp_plugin.bench.rank_replay import RankReplay, _shards

    events = _call_order(monkeypatch, allgather, ("block_fwd", "block_bwd"))
    rep = RankReplay("allgather", P, P // 2, *_shards(24 * P, P, 2, 2, 8, torch.device("cpu"), torch.float32))
    rep()                                        # prepares the receives
    events.clear()
    rep()
    starts = [i for i, e in enumerate(events) if e == "gather" and (i == 0 or events[i - 1] != "gather")]
    assert len(starts) == 2, events                                     # one batch of gathers a pass
    for a, b in zip(starts, starts[1:] + [len(events)]):
        phase = [e for e in events[a:b] if e != "gather"]
        assert phase[0] == ("block_fwd" if a == 0 else "block_bwd") and "wait" in phase[1:], events


@pytest.mark.parametrize("P,grid,own_first", [(2, (2, 1), True), (4, (4, 1), True), (4, (1, 4), True),
                                              (4, (2, 2), False), (8, (4, 2), False)])
def test_attention2d_no_computes_its_own_pair_while_the_gathers_run(monkeypatch, P, grid, own_first):
    """Attention2D-NO posts its row and column gathers and, where every chunk pair is a call of its own (groups of
    one chunk: 2 x 1, 4 x 1, 1 x 4), computes its own pair before it waits for them, forward and backward; grouped
    chunks (2 x 2, 4 x 2 at these tiny shards) wait first. The order of kernel calls and waits, on a replayed rank;
    red with the pairs in plain order."""
    from megatron_cp_plugin.algos import attention2d
    from megatron_cp_plugin.bench.rank_replay import RankReplay, _shards

    events = _call_order(monkeypatch, attention2d, ("block_fwd_into", "block_bwd_into"))
    rep = RankReplay("attention2d-no", P, 1, *_shards(8 * P, P, 2, 2, 8, torch.device("cpu"), torch.float32),
                     grid=grid)
    rep()                                        # prepares the receives
    events.clear()
    rep(mark=lambda: events.append("|"))
    events = [e for e in events if e != "gather"]
    cut = events.index("|")
    for kernel, phase in (("block_fwd_into", events[:cut]), ("block_bwd_into", events[cut + 1:])):
        assert set(phase) == {kernel, "wait"}, (kernel, events)
        assert (phase[0] == kernel) == own_first, (kernel, events)



@pytest.mark.parametrize("P,grid,split", [(2, (2, 1), True), (3, (3, 1), True), (4, (4, 1), True),
                                          (4, (1, 4), False), (4, (2, 2), False)])
def test_attention2d_no_computes_the_own_keys_while_its_dkv_partials_travel(monkeypatch, P, grid, split):
    """On an R x 1 grid Attention2D-NO's backward posts the other K, V chunks' dK, dV partials to their owners
    before the last part of its own pair (its keys [s1:]), which it computes while they travel, and sums them after:
    the order of kernel calls and of the exchange's post and wait, on a replayed rank (causal). Other grids run
    the plain order (no early post). Red with the post moved after the last call."""
    from megatron_cp_plugin.algos import attention2d
    from megatron_cp_plugin.bench.rank_replay import RankReplay, _shards

    events = _call_order(monkeypatch, attention2d, ("block_bwd_into",))
    real_start = attention2d.reduce_at_owner_start

    def start(*a, **k):
        events.append("post")
        posted = real_start(*a, **k)
        real_wait = posted.wait
        posted.wait = lambda own: (events.append("summed"), real_wait(own))[1]
        return posted

    monkeypatch.setattr(attention2d, "reduce_at_owner_start", start)
    rep = RankReplay("attention2d-no", P, 1, *_shards(8 * P, P, 2, 2, 8, torch.device("cpu"), torch.float32),
                     grid=grid)
    rep()                                        # prepares the receives
    events.clear()
    rep(mark=lambda: events.append("|"))
    bwd = [e for e in events[events.index("|") + 1:] if e not in ("gather", "wait")]
    if not split:
        assert "post" not in bwd, bwd
        return
    # the own pair's keys [:s1] (two calls), the R - 1 other chunks' pairs, the post, the own keys [s1:], the sum
    assert bwd == ["block_bwd_into"] * (2 + P - 1) + ["post", "block_bwd_into", "summed"], bwd


@pytest.mark.parametrize("cap,calls", [(32, 1), (31, 4), (16, 4), (15, 16), (8, 16)])
def test_attention2d_no_groups_its_calls_within_the_grids_cap(monkeypatch, cap, calls):
    """The grid's group cap (CPGrid.group_tokens, --cp-group-tokens) bounds the query tokens of one grouped kernel
    call: on 4 x 4 with 8 tokens a rank, groups of n = 4 chunks (32 rows, 1 call a pass), n = 2 (16 rows, 2 x 2
    calls) or n = 1 (16 calls), forward and backward alike. Red with the grid's cap ignored."""
    from megatron_cp_plugin.algos import attention2d
    from megatron_cp_plugin.bench.rank_replay import RankReplay, _shards

    events = _call_order(monkeypatch, attention2d, ("block_fwd_into", "block_bwd_into"))
    rep = RankReplay("attention2d-no", 16, 5, *_shards(8 * 16, 16, 2, 2, 8, torch.device("cpu"), torch.float32),
                     grid=(4, 4), group_tokens=cap)
    rep()
    assert rep.group.group_tokens == cap
    assert events.count("block_fwd_into") == calls and events.count("block_bwd_into") == calls, events


@pytest.mark.parametrize("cap,most", [(24, 3), (16, 2), (8, 0)])
def test_attention2d_o_batches_within_the_grids_cap(monkeypatch, cap, most):
    """Attention2D-O's batched passes (3 x 3, 8 tokens a rank, its own schedule forced) take at most the grid's cap
    of query rows a call (CPGrid.group_tokens): up to 3 of the column's chunks a call at 24, 2 at 16, and at 8 one
    chunk a call (the per-chunk calls of pass 0), forward and backward (C = 3: one middle pass, whose chunks the
    masks split 2 + 1 on this rank). Red with the grid's cap ignored."""
    from megatron_cp_plugin import cp_grid
    from megatron_cp_plugin.algos import attention2d_o
    from megatron_cp_plugin.bench.rank_replay import RankReplay, _shards

    monkeypatch.setattr(cp_grid, "OVERLAP_MIN_LOCAL", 0)
    chunks = {"block_fwd": [], "block_bwd": []}            # chunks (the batch dimension, b = 1) of each batched call
    for name, arg in (("block_fwd", 0), ("block_bwd", 1)):
        real = getattr(attention2d_o, name)
        monkeypatch.setattr(attention2d_o, name, lambda *a, _r=real, _n=name, _i=arg, **k:
                            (chunks[_n].append(a[_i].shape[0]), _r(*a, **k))[1])
    rep = RankReplay("attention2d-o", 9, 4, *_shards(8 * 9, 9, 2, 2, 8, torch.device("cpu"), torch.float32),
                     grid=(3, 3), group_tokens=cap)
    rep()
    assert max(chunks["block_fwd"], default=0) == most, chunks          # rank 4's forward fills the cap
    assert 0 < max(chunks["block_bwd"]) <= most if most else not chunks["block_bwd"], chunks   # one middle pass


def test_a_posted_batch_lands_in_one_copy_per_dtype(monkeypatch):
    """A batch of receives of mixed dtypes (burst's Q, dO bf16 and D, lse fp32) is one multi-tensor copy a dtype, not
    foreach's slow path of one copy a tensor; the bytes land where they belong. Red with the grouping removed."""
    from megatron_cp_plugin.bench import _replay_comm
    calls = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda o, s: (calls.append({t.dtype for t in o}), real(o, s))[1])
    src = [torch.randn(3, 4).to(dt) for dt in (torch.bfloat16, torch.bfloat16, torch.float32, torch.float32)]
    d = _replay_comm.ReplayDist(2, 0, source=list(src))
    outs = [torch.zeros_like(t) for t in src]
    ops = [d.P2POp(d.isend, t, 1) for t in src] + [d.P2POp(d.irecv, t, 1) for t in outs]
    for w in d.batch_isend_irecv(ops):
        w.wait()
    assert sorted(len(c) for c in calls) == [1, 1] and len(calls) == 2, calls
    assert all(torch.equal(a, b) for a, b in zip(outs, src)) and d.copies == 4


def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: the replay's wire stream runs on GPUs only (scripts/gpu_tests.sh)")


def test_a_posted_batch_runs_on_the_wire_stream_and_wait_orders_it():
    """On a GPU a posted batch's copies run on the wire stream (behind a sleep there, the rank's stream reads the
    buffer before they land) and its work's wait() makes the rank's stream wait for them (then it reads the bytes)."""
    _needs_cuda()
    from megatron_cp_plugin.bench import _replay_comm
    src = torch.randn(1 << 20, device="cuda")
    d = _replay_comm.ReplayDist(2, 0, source=[src])
    d.delay_cycles = 200_000_000                            # ~0.1 s on the wire stream before the copy
    out = torch.full_like(src, float("nan"))
    (work,) = d.batch_isend_irecv([d.P2POp(d.isend, src, 1), d.P2POp(d.irecv, out, 1)])
    early = out.clone()                                     # on the rank's stream, not waiting
    work.wait()
    late = out.clone()
    assert torch.isnan(early).all(), "the copy ran on the rank's stream (or before the post returned)"
    assert torch.equal(late, src), "wait() did not order the rank's stream after the wire's copy"


@pytest.mark.parametrize("algo,grid", [("ring", None), ("burst", None), ("allgather", None),
                                       ("attention2d-o", (2, 2)), ("attention2d-no", (2, 2))])
def test_the_wire_stream_replays_the_same_bits_as_inline(algo, grid):
    """A replay with its receives on the wire stream (each batch behind a sleep, so that a missing wait would read
    a buffer before it lands) gives the inline replay's outputs and gradients bit for bit, at P = 4 and 8."""
    _needs_cuda()
    from megatron_cp_plugin.bench.rank_replay import _shards
    for P in (4, 8):
        if grid is not None and P == 8:
            grid = (4, 2)
        shards = _shards(64 * P, P, 4, 2, 64, torch.device("cuda"), torch.bfloat16)
        inline = RankReplay(algo, P, P // 2 + 1, *shards, grid=grid, wire="inline")
        inline()                                            # prepares (inline)
        want = inline()
        stream = RankReplay(algo, P, P // 2 + 1, *shards, grid=grid, source=inline.d.source)
        stream.d.delay_cycles = 2_000_000
        got = stream()
        for name, x, y in zip(("o", "dq", "dk", "dv"), got, want):
            assert torch.equal(x, y), f"{algo} P={P} {name}"
        assert stream.d.copies == inline.d.copies


def test_ring_rounds_send_partials_in_the_input_dtype():
    """In rounds (P = 8, short shards) every dK, dV partial is one kernel call's result, summed once at its owner: it
    travels in bf16 (a GPU's fused kernel returns it so; the CPU's math backend's fp32 is rounded to it), so ring's
    replayed receives are ring-te's bytes: K, V twice and the partials once, all bf16."""
    from megatron_cp_plugin.algos.ring import round_size
    from megatron_cp_plugin.bench.rank_replay import _shards
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    P, S = 8, 8 * 64
    assert round_size(P, S // P) > 1
    shards = _shards(S, P, 4, 2, 64, dev, torch.bfloat16)
    copied = {}
    for algo in ("ring", "ring-te"):
        rep = RankReplay(algo, P, 3, *shards)
        rep()
        rep()
        copied[algo] = rep.d.copied_bytes
    kv = 2 * (P - 1) * shards[1].numel() * 2                  # K, V once in the forward and once in the backward
    assert copied["ring"] == copied["ring-te"] == 3 * kv, copied


def test_round_partials_make_one_zero_piece_a_round_at_most(monkeypatch):
    """The chunks no call meets go home as one zeros tensor a round (per shape), not one per piece (a
    dict.setdefault that built its default every time made 38 a backward at P = 64: 92 more ops on an H100)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from megatron_cp_plugin.algos import ring
    from megatron_cp_plugin.bench.rank_replay import _shards

    made = []

    class Zeros(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            made.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    real = ring.RoundPartials.post_home

    def counted(self, ex, dists):
        with Zeros():
            return real(self, ex, dists)

    monkeypatch.setattr(ring.RoundPartials, "post_home", counted)
    P, S = 16, 16 * 32
    rep = RankReplay("ring", P, P - 1, *_shards(S, P, 2, 2, 16, torch.device("cpu"), torch.float32))
    rep()
    made.clear()
    rep()
    rounds = len(ring.round_distances(P, ring.round_size(P, S // P)))
    assert 0 < made.count("zeros") <= rounds, made


@pytest.mark.parametrize("algo", ["ring", "burst"])
def test_rounds_make_their_per_peer_views_in_one_call_a_tensor(monkeypatch, algo):
    """At P = 64 a round meets 16 peers, 4 tensors each: the receive buffers' and partials' per-peer views come from
    one unbind (or split) a tensor, not one select or slice a peer (2k tokens a rank are host-bound; ring's rounds
    made 1016 selects and ~430 slices a fwd+bwd before). Counted over a fwd+bwd: the select and slice views made
    inside algos/ring.py."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode
    from megatron_cp_plugin.algos import ring
    from megatron_cp_plugin.bench.rank_replay import _shards

    views = []

    class Views(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("select", "slice") and any(
                    f.filename.endswith("algos/ring.py") for f in traceback.extract_stack(limit=12)):
                views.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    P, s = 64, 32
    monkeypatch.setattr(ring, "ROUND_TOKENS", 16 * s)              # rounds of 16 peers, as at 2k tokens a rank
    rep = RankReplay(algo, P, 40, *_shards(P * s, P, 1, 1, 8, torch.device("cpu"), torch.float32))
    rep()
    assert ring.round_size(P, s) == 16
    with Views():
        rep()
    # one view a peer and tensor would be 16 peers x 4 tensors x 4 rounds x 2 (forward, backward) = 512 at least;
    # what is left is per call (a call's query rows, keys, lse): ~110 here
    assert len(views) <= 256, (len(views), views.count("select"), views.count("slice"))


def test_slowest_rank_looks_twice_at_the_slowest():
    """The slowest rank is the largest median of a second look at the first pass's slowest few, not the first pass's
    largest single call: ring's ranks differ by about one call's noise (one call a rank picked ring's rank 39 at 128k
    over P = 64 where ranks 0-5 are 6 % slower, twenty-eighth session)."""
    from megatron_cp_plugin.bench import rank_cli

    true = [10.0, 12.0, 11.0, 10.5, 9.0, 11.5, 10.0, 9.5]            # rank 1 is the slowest
    noise = {6: 5.0}                                                # rank 6's one call hit a hiccup
    calls = []

    def timer(r, n):
        calls.append((r, n))
        return true[r] + (noise.get(r, 0.0) if n == 1 else 0.0)
    assert rank_cli.slowest_rank("ring", 8, None, (), timer=timer) == 1
    assert [c for c in calls if c[1] == 1] == [(r, 1) for r in range(8)]
    assert sorted(r for r, n in calls if n > 1) == [1, 2, 5, 6]     # the four slowest of the first look, again
