"""bench/plots.py: the `attention` and `rank` figures drawn from rows as the benchmarks write them, checked on
what they show (one color per algorithm, distinct across algorithms, anchors marked, the ideal line where it
belongs, no bar for a row that did not run), and `megatron-cp-bench plot` drawing old and new result JSONs.

Fixtures: tests/data/attention_128k.json is docs/results/attention_128k.json (2 x H200, S = 128k, with torch CP
anchors and two anchors not run); the three-length attention and the rank rows are synthetic, keyed as
cp_attention.py and rank_cli.py write them."""
from __future__ import annotations

import json
import pathlib

import pytest

pytest.importorskip("matplotlib", reason="bench/plots.py draws with matplotlib (pip install matplotlib)")
from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from megatron_cp_plugin.bench import plots  # noqa: E402

DATA = pathlib.Path(__file__).parent / "data"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HEADER = ("cp_attention: b=1 h=32 h_kv=8 d=128 causal=True torch.bfloat16 on 4 x NVIDIA H200. fwd FLOP = 4 * b * h"
          " * S^2 * d * (1/2 if causal). Median of 10 after 3 warm-up.")
OURS = ["ring", "ring-te", "burst", "attention2d-no", "attention2d-o", "allgather", "ulysses", "ulysses-ring"]
ANCHORS = ["torch-cp-allgather-cudnn", "torch-cp-alltoall-cudnn", "torch-cp-alltoall-flash", "te-p2p"]


def _real_attention():
    res = json.loads((DATA / "attention_128k.json").read_text())
    return res["rows"], res["header"], res["device"]


def _attention_rows(lengths=(32768, 131072, 524288), P=4):
    """As cp_attention.bench writes them: the single-GPU row, every algorithm and anchor per S; ring-flash-attn
    unavailable (its reason in the name), allgather not fitting at the longest length (a `not_run` row)."""
    rows = []
    for S in lengths:
        ref = 27.6 * (S / 32768) ** 2
        rows.append({"S": S, "algo": "single-GPU cudnn", "P": 1, "fwd_ms": ref / 3.5, "fwd_bwd_ms": ref,
                     "fwd_x_single": 1.0, "fwd_bwd_x_single": 1.0, "MB_sent_fwd_bwd": 0.0, "peak_GiB": 5.0})
        for i, algo in enumerate(OURS + ANCHORS):
            if algo == "allgather" and S == lengths[-1]:
                rows.append({"S": S, "algo": algo, "P": P,
                             "not_run": "not run: needs 160.3 GiB of 139.1 GiB free on NVIDIA H200"})
                continue
            x = 1 / P * (1.05 + 0.02 * i) * (1 + (32768 / S) ** 0.5)
            rows.append({"S": S, "algo": algo, "P": P, "fwd_ms": x * ref / 3.5, "fwd_bwd_ms": x * ref,
                         "fwd_x_single": x, "fwd_bwd_x_single": x, "MB_sent_fwd_bwd": 100.0, "peak_GiB": 8.0})
        rows.append({"S": S, "algo": "ring-flash-attn (not run: ring-flash-attn (and flash-attn) is not installed)",
                     "P": P})
    return rows


def _rank_rows():
    """As rank_cli.main writes them: per h/h_kv, N and P, every algorithm (Attention2D on two grids); at 1M
    the ideal comes from the rate at 256k; one row did not fit, one has no ideal."""
    rows = []
    for hk in (32, 8):
        for S in (131072, 1048576):
            for P in (4, 16, 64):
                if S // P > 65536:
                    continue
                r = round(P ** 0.5)
                square, rect = (r, r) if r * r == P else (2, P // 2), (2 * r, P // (2 * r)) if r % 2 == 0 else (P, 1)
                cfgs = [("ring", "-"), ("ring-te", "-"), ("burst", "-")] + [
                    (a, f"{g[0]}x{g[1]}") for a in ("attention2d-no", "attention2d-o") for g in (square, rect)]
                for k, (algo, grid) in enumerate(cfgs):
                    row = {"S": S, "h/h_kv": f"32/{hk}", "P": P, "algo": algo, "grid": grid}
                    if (S, hk, P, algo, grid) == (1048576, 32, 16, "attention2d-no", "8x2"):
                        row["not_run"] = "not run: needs 150.2 GiB of 139.1 GiB free on NVIDIA H200"
                        rows.append(row)
                        continue
                    x = 1.05 + 0.04 * k + 0.01 * (P // 4)
                    row.update(rank=P - 1, fwd_ms=0.3 * x, bwd_ms=0.7 * x, fwd_bwd_ms=x)
                    if (S, hk, P, algo) != (1048576, 8, 64, "burst"):
                        row.update(ideal_ms=1.0, x_ideal=x, x_model=1.1,
                                   ideal_from="measured" if S <= 262144 else "rate at S=262144")
                    row.update(ops=44, attn_calls=2 * P, copies=10, copy_MB=12.0, iters=3)
                    rows.append(row)
    return rows


def _is_png(path) -> bool:
    return pathlib.Path(path).read_bytes()[:8] == PNG_MAGIC


def _bars(fig) -> dict:
    """gid 'bar:<algo>[...]' -> the Rectangle, over every axes."""
    return {p.get_gid(): p for ax in fig.axes for p in ax.patches
            if isinstance(p, Rectangle) and (p.get_gid() or "").startswith("bar:")}


def _by_gid(fig, prefix: str) -> list:
    return [a for ax in fig.axes for a in ax.get_children() if (a.get_gid() or "").startswith(prefix)]


def _one_color_per_algo(pairs):
    """pairs of (algo, artist color): each algorithm one color, different algorithms different colors."""
    seen: dict = {}
    for algo, c in pairs:
        seen.setdefault(algo, set()).add(to_hex(c))
    assert all(len(cs) == 1 for cs in seen.values()), seen
    flat = [next(iter(cs)) for cs in seen.values()]
    assert len(set(flat)) == len(flat), seen
    return {a: next(iter(cs)) for a, cs in seen.items()}


def test_colors_are_fixed_and_distinct_for_every_known_algorithm():
    from megatron_cp_plugin.algos import registry
    from megatron_cp_plugin.bench.anchors import builders

    ours, anchors = list(registry.names(baselines=True)), list(builders(True))
    names = ours + anchors
    assert len({plots.color(n) for n in names}) == len(names)          # up to 14 series, no color twice
    assert all(not plots.is_anchor(n) for n in ours) and all(plots.is_anchor(n) for n in anchors)
    assert plots.color("some-new-algo") == plots.color("some-new-algo")  # a hash of the name, not the order
    assert plots.split_name("te-p2p (not run: transformer-engine is not installed (pip install x))") == (
        "te-p2p", "not run: transformer-engine is not installed (pip install x)")
    assert [plots.seq_label(s) for s in (64, 32768, 131072, 2**20)] == ["64", "32k", "128k", "1M"]
    assert plots.first_sentence(HEADER) == "cp_attention: b=1 h=32 h_kv=8 d=128 causal=True bf16 on 4 x NVIDIA H200"


def test_attention_one_length_is_a_bar_per_algorithm(tmp_path):
    """The measured 2 x H200 result: a bar per algorithm that ran, its value fwd+bwd / one GPU's, anchors hatched
    and labelled, the 1/P ideal at 0.5, the two unavailable anchors a labelled gap without a bar."""
    rows, header, device = _real_attention()
    png = tmp_path / "attention.png"
    fig = plots.draw(rows, str(png), {"kind": "attention"}, header=header, device=device)
    assert _is_png(png)
    bars = _bars(fig)
    ran = {r["algo"]: r["fwd_bwd_x_single"] for r in rows if "fwd_bwd_x_single" in r and r["P"] > 1}
    assert set(bars) == {f"bar:{a}" for a in ran}
    for algo, x in ran.items():
        assert bars[f"bar:{algo}"].get_width() == pytest.approx(x)
        assert bool(bars[f"bar:{algo}"].get_hatch()) == algo.startswith("torch-cp-")
    _one_color_per_algo((g[4:], b.get_facecolor()) for g, b in bars.items())
    ax = fig.axes[0]
    (ideal,) = _by_gid(fig, "ideal")
    assert list(ideal.get_xdata()) == [0.5, 0.5]
    ticks = [t.get_text() for t in ax.get_yticklabels()]
    assert "torch-cp-allgather-cudnn (anchor)" in ticks and "ring" in ticks
    assert ticks.index("attention2d-o") < ticks.index("torch-cp-allgather-cudnn (anchor)")   # ours first
    gaps = {a.get_gid(): a.get_text() for a in _by_gid(fig, "not-run:")}
    assert set(gaps) == {"not-run:te-p2p", "not-run:ring-flash-attn"}
    assert gaps["not-run:te-p2p"].startswith("not run: transformer-engine is not installed")
    title = ax.get_title(loc="left")
    assert "NVIDIA H200" in title and "1.0 = one GPU" in title and "P = 2" in title
    assert "bf16 on 2 x NVIDIA H200" in title                      # 'torch.bfloat16' no longer ends the title


def test_attention_several_lengths_is_a_line_per_algorithm(tmp_path):
    rows = _attention_rows()
    png = tmp_path / "attention3.png"
    fig = plots.draw(rows, str(png), {"kind": "attention"}, header=HEADER, device="NVIDIA H200")
    assert _is_png(png)
    assert not _bars(fig)
    lines = {ln.get_gid()[5:]: ln for ln in _by_gid(fig, "line:")}
    assert set(lines) == set(OURS + ANCHORS)                        # ring-flash-attn never ran: no line
    colors = _one_color_per_algo((a, ln.get_color()) for a, ln in lines.items())
    assert colors == {a: to_hex(plots.color(a)) for a in lines}     # the fixed colors, as in every figure
    for algo, ln in lines.items():
        assert (ln.get_linestyle() == "--") == (algo in ANCHORS)
        assert ln.get_label().endswith("(anchor)") == (algo in ANCHORS)
        pts = {r["S"]: r["fwd_bwd_x_single"] for r in rows if r["algo"] == algo and "fwd_bwd_x_single" in r}
        assert dict(zip(ln.get_xdata(), ln.get_ydata())) == pytest.approx(pts)
    assert len(lines["allgather"].get_xdata()) == 2                  # not run at 512k: no point there
    (ideal,) = _by_gid(fig, "ideal")
    assert list(ideal.get_ydata()) == [0.25, 0.25]
    (notes,) = [t for t in fig.texts if t.get_gid() == "not-run-notes"]
    assert "allgather at 512k: not run: needs 160.3 GiB" in notes.get_text().replace("\n", " ")
    assert "ring-flash-attn at 32k, 128k, 512k" in notes.get_text().replace("\n", " ")
    assert fig.axes[0].get_legend() is not None
    # the same algorithm gets the same color in the one-length figure
    fig1 = plots.draw([r for r in rows if r["S"] == 131072], str(tmp_path / "one.png"), {"kind": "attention"},
                      header=HEADER)
    assert {g[4:]: to_hex(b.get_facecolor()) for g, b in _bars(fig1).items()} == {
        a: c for a, c in colors.items()}


def test_attention_without_a_single_gpu_time_draws_milliseconds(tmp_path):
    rows = [r for r in _attention_rows(lengths=(131072,)) if not r["algo"].startswith("single-GPU")]
    for r in rows:
        r.pop("fwd_bwd_x_single", None)
    fig = plots.draw(rows, str(tmp_path / "ms.png"), {"kind": "attention"}, header=HEADER)
    bars = _bars(fig)
    assert bars["bar:ring"].get_width() == pytest.approx(next(r["fwd_bwd_ms"] for r in rows if r["algo"] == "ring"))
    assert not _by_gid(fig, "ideal") and "milliseconds" in fig.axes[0].get_title(loc="left")


def test_rank_figure_facets_per_length_and_heads(tmp_path):
    rows = _rank_rows()
    png = tmp_path / "rank.png"
    header = ("rank_replay: one rank's local work per algorithm, replayed on one NVIDIA H200 (communication "
              "replaced by on-device copies); b=1 d=128 causal torch.bfloat16. ideal = one-device fwd+bwd / P.")
    fig = plots.draw(rows, str(png), {"kind": "rank"}, header=header, device="NVIDIA H200")
    assert _is_png(png)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    titles = sorted(ax.get_title() for ax in axes)
    assert titles == sorted([f"N = {n} tokens, h/h_kv = 32/{k} ({m}){src}" for n, src in
                             (("128k", ""), ("1M", "; ideal from the rate at S=262144"))
                             for k, m in ((32, "MHA"), (8, "GQA"))])
    bars = _bars(fig)
    ran = [r for r in rows if "x_ideal" in r]
    assert len(bars) == len(ran)
    for r in ran:
        gid = f"bar:{r['algo']}:{r['grid']}:P{r['P']}:S{r['S']}:{r['h/h_kv']}"
        assert bars[gid].get_width() == pytest.approx(r["x_ideal"])
    _one_color_per_algo((g.split(":")[1], b.get_facecolor()) for g, b in bars.items())
    ideals = _by_gid(fig, "ideal")
    assert len(ideals) == len(axes) and all(list(ln.get_xdata()) == [1.0, 1.0] for ln in ideals)
    gaps = {a.get_gid(): a.get_text() for a in _by_gid(fig, "not-run:")}
    assert gaps == {"not-run:attention2d-no:8x2:P16:S1048576:32/32": "not run: needs 150.2 GiB of 139.1 GiB free "
                                                                     "on NVIDIA H200",
                    "not-run:burst:-:P64:S1048576:32/8": "no ideal: one device could not run the whole sequence"}
    assert "1.0 = the ideal" in fig._suptitle.get_text() and "NVIDIA H200" in fig._suptitle.get_text()
    assert [t.get_text() for t in fig.legends[0].get_texts()][:5] == ["ring", "ring-te", "burst", "attention2d-no",
                                                                     "attention2d-o"]


def test_plot_subcommand_draws_new_and_old_jsons(tmp_path):
    """`megatron-cp-bench plot`: a JSON naming {"kind": ...} draws that figure, an old (x, y, series) one the
    log-log lines as before, --kind draws a figure for a JSON that names none."""
    from megatron_cp_plugin.bench.cli import main

    rows, header, device = _real_attention()
    for name, plot in (("new", {"kind": "attention"}), ("old", ["S", "fwd_bwd_ms", "algo"]), ("none", None)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"header": header, "device": device, "plot": plot,
                                                           "rows": rows}))
    (tmp_path / "rank.json").write_text(json.dumps({"header": "rank_replay: x", "plot": {"kind": "rank"},
                                                    "rows": _rank_rows()}))
    assert main(["plot", str(tmp_path / "new.json"), str(tmp_path / "old.json"), str(tmp_path / "rank.json")]) == 0
    assert all(_is_png(tmp_path / f"{n}.png") for n in ("new", "old", "rank"))
    with pytest.raises(SystemExit, match="names no figure"):
        main(["plot", str(tmp_path / "none.json")])
    assert main(["plot", "--kind", "attention", str(tmp_path / "none.json")]) == 0 and _is_png(tmp_path / "none.png")
    # the old triple still draws one log-log line per series
    fig = plots.draw(rows, str(tmp_path / "old2.png"), ["S", "fwd_bwd_ms", "algo"], header=header)
    assert fig.axes[0].get_xscale() == "log" and len(fig.axes[0].lines) == 9
