"""The benchmark figures (matplotlib), each drawn from a result's rows alone, so that `megatron-cp-bench plot
results/x.json` draws it again later from the JSON. A result's "plot" entry names its figure:

  {"kind": "attention"}  `bench attention` (cp_attention.py): per algorithm, fwd+bwd time over one GPU's on the
                         whole sequence, the 1/P ideal marked. One sequence length: a horizontal bar per
                         algorithm, its value at the bar's end; several: a line per algorithm over S.
  {"kind": "rank"}       `bench rank` (rank_cli.py): the slowest rank's fwd+bwd over the ideal (one device's
                         fwd+bwd / P) per algorithm and grid, grouped by P, 1.0 marked; one panel per (N, h/h_kv).
  [x, y, series]         older results and the other benches: one log-log line of y over x per series (plot_rows).

Every algorithm has one color in every figure (COLORS, keyed by name); the external anchors (PyTorch native CP,
TransformerEngine, ring-flash-attn; bench/anchors.py) are hatched or dashed and labelled "(anchor)". Rows that
did not run (a `not_run` reason, or an anchor named "<name> (not run: <reason>)") get no bar or point: one
bar-chart row says "not run: <reason>"; the line chart lists them under the plot.

Each drawing function returns the matplotlib Figure (saved to `png`, closed), or None without matplotlib. Its
bars, lines and points carry gids ("bar:<algo>", "line:<algo>", "ideal", "one-gpu", "not-run:<algo>") that
tests/test_bench_plots.py reads back (the rank figure's add ":<grid>:P<P>:S<N>:<h/h_kv>").
"""
from __future__ import annotations

import math
import re
import textwrap
import zlib

# ----------------------------------------------------------------------------------------------- colors
OURS = {"ring": "#1f77b4", "ring-te": "#17becf", "burst": "#ff7f0e", "attention2d-no": "#2ca02c",
        "attention2d-o": "#d62728", "allgather": "#9467bd", "ulysses": "#8c564b", "ulysses-ring": "#e377c2"}
"""Our algorithms (algos/registry.py, ring-te included): tab10's colors, grey and olive left to the anchors."""
ANCHORS = {"torch-cp-allgather-cudnn": "#bcbd22", "torch-cp-alltoall-cudnn": "#7f7f7f",
           "torch-cp-allgather-flash": "#393b79", "torch-cp-alltoall-flash": "#843c39",
           "te-p2p": "#8c6d31", "ring-flash-attn": "#7b4173"}
"""The external anchors of bench/anchors.py (tab10's olive and grey, tab20b's darkest shades)."""
COLORS = {**OURS, **ANCHORS}
SPARE = ("#637939", "#e7ba52", "#6b6ecf", "#ad494a", "#ce6dbd", "#3182bd", "#31a354", "#756bb1", "#e6550d",
         "#636363")
"""For a name not in COLORS: one of these, picked by a hash of the name (the same in every figure)."""
ANCHOR_PREFIXES = ("torch-cp-", "te-", "ring-flash-attn")
_TEXT_BOX = {"facecolor": "white", "edgecolor": "none", "pad": 0.6, "alpha": 0.85}
IDEAL_STYLE = {"color": "black", "linestyle": "--", "linewidth": 1.2}
ONE_GPU_STYLE = {"color": "0.45", "linestyle": ":", "linewidth": 1.2}


def color(algo: str) -> str:
    """The one color of `algo` in every figure."""
    return COLORS.get(algo) or SPARE[zlib.crc32(algo.encode()) % len(SPARE)]


def is_anchor(algo: str) -> bool:
    """An external implementation (bench/anchors.py), not one of ours."""
    return algo in ANCHORS or algo.startswith(ANCHOR_PREFIXES)


def label(algo: str) -> str:
    return f"{algo} (anchor)" if is_anchor(algo) else algo


def split_name(algo: str) -> tuple[str, str | None]:
    """cp_attention names an unavailable anchor "te-p2p (not run: <reason>)": ("te-p2p", "not run: <reason>")."""
    m = re.fullmatch(r"(\S+) \((not run: .*)\)", algo, flags=re.DOTALL)
    return (m.group(1), m.group(2)) if m else (algo, None)


def seq_label(s: int) -> str:
    """131072 -> '128k', 1048576 -> '1M', 1000 -> '1000'."""
    for unit, n in (("M", 2**20), ("k", 2**10)):
        if s >= n and s % n == 0:
            return f"{s // n}{unit}"
    return str(s)


def first_sentence(header: str) -> str:
    """A report header's first sentence (up to '. ', so that 'torch.bfloat16' stays whole), dtypes shortened."""
    head = re.split(r"\.(?:\s|$)", header, maxsplit=1)[0]
    return head.replace("torch.bfloat16", "bf16").replace("torch.float16", "fp16").replace("torch.float32", "fp32")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _no_matplotlib(png: str) -> None:
    print(f"(no matplotlib: {png} not drawn; pip install matplotlib, then megatron-cp-bench plot)")


def _wrap(text: str, width: int) -> str:
    return "\n".join(textwrap.wrap(text, width)) if text else ""


# ----------------------------------------------------------------------------------------------- dispatch
def draw(rows, png: str, plot, *, header: str = "", device: str | None = None):
    """Draw the figure `plot` names (a result JSON's "plot" entry: {"kind": ...} or an (x, y, series) triple)."""
    title = first_sentence(header)
    if isinstance(plot, dict):
        kind = plot.get("kind")
        if kind == "attention":
            return attention_figure(rows, png, title=title, device=device)
        if kind == "rank":
            return rank_figure(rows, png, title=title, device=device)
        if kind == "lines":
            return plot_rows(rows, png, plot["x"], plot["y"], plot["series"], title=title)
        raise ValueError(f"unknown figure kind {kind!r}; expected attention, rank or lines")
    x, y, series = plot
    return plot_rows(rows, png, x, y, series, title=title)


def plot_rows(rows, png: str, x: str, y: str, series: str, title: str = ""):
    """A log-log line per `series` value of y against x (rows without y, such as not-run ones, left out); None
    (and a message) without matplotlib."""
    plt = _pyplot()
    if plt is None:
        _no_matplotlib(png)
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    rows = [r for r in rows if y in r and "not_run" not in r]
    for name in dict.fromkeys(r[series] for r in rows):
        pts = sorted((r[x], r[y]) for r in rows if r[series] == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=str(name))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title[:90], fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return fig


# ----------------------------------------------------------------------------------------------- attention
def attention_entries(rows) -> dict:
    """cp_attention's rows sorted out: {"P", "lengths", "reference": {S: one GPU's ms}, "algos": [name, ...] in
    row order (ours, then anchors), "points": {algo: {S: (value, ms)}}, "not_run": {algo: {S: reason}},
    "lost": {S: reason} (a length whose inputs did not fit), "metric": "x_single" | "ms"}. value: fwd+bwd over
    one GPU's (fwd_bwd_x_single); where no length has one (the one-GPU row did not fit), the ms themselves."""
    out = {"reference": {}, "algos": [], "points": {}, "not_run": {}, "lost": {}}
    Ps, lengths = [], []
    ratio = any(_finite(r.get("fwd_bwd_x_single")) and not r["algo"].startswith("single-GPU") for r in rows)
    out["metric"] = "x_single" if ratio else "ms"
    for r in rows:
        S, name = r["S"], r["algo"]
        if S not in lengths:
            lengths.append(S)
        if name.startswith("inputs"):                       # the full q, k, v, dO of that length did not fit
            out["lost"][S] = r.get("not_run", "not run")
            continue
        if name.startswith("single-GPU"):
            if _finite(r.get("fwd_bwd_ms")):
                out["reference"][S] = r["fwd_bwd_ms"]
            continue
        algo, why = split_name(name)
        why = why or r.get("not_run")
        if algo not in out["algos"]:
            out["algos"].append(algo)
        Ps.append(r.get("P", 1))
        value = r.get("fwd_bwd_x_single") if ratio else r.get("fwd_bwd_ms")
        if why:
            out["not_run"].setdefault(algo, {})[S] = why
        elif _finite(value):
            out["points"].setdefault(algo, {})[S] = (value, r.get("fwd_bwd_ms"))
        else:
            out["not_run"].setdefault(algo, {})[S] = "no one-GPU time to compare with"
    out["algos"].sort(key=is_anchor)                        # stable: ours in row order, then the anchors
    out["P"] = max(Ps, default=1)
    out["lengths"] = sorted(lengths)
    return out


def _attention_title(e, title: str, device: str | None, lengths: str) -> str:
    P = e["P"]
    what = (f"fwd+bwd time / one GPU's, {lengths}, P = {P}" if e["metric"] == "x_single"
            else f"fwd+bwd time (ms), {lengths}, P = {P}")
    head = title or "cp_attention"
    if device and device not in head:
        head += f" on {device}"
    if e["metric"] == "x_single":
        one = ", ".join(f"{seq_label(s)}: {_ms(ms)}" for s, ms in sorted(e["reference"].items()))
        means = f"1.0 = one GPU on the whole sequence ({one}); dashed: the ideal 1/P = {1 / P:.3g}"
    else:
        means = "no one-GPU time (it did not fit): milliseconds, lower is better"
    return f"{what}\n{_wrap(head, 120)}\n{_wrap(means, 120)}"


def attention_figure(rows, png: str, title: str = "", device: str | None = None):
    """The `attention` bench's figure: one length, a bar per algorithm; several, a line per algorithm over S."""
    plt = _pyplot()
    if plt is None:
        _no_matplotlib(png)
        return None
    e = attention_entries(rows)
    if not e["lengths"]:
        return _empty(plt, png, title or "cp_attention")
    drawn = [S for S in e["lengths"] if S not in e["lost"]]
    if len(drawn) <= 1:
        return _attention_bars(plt, e, drawn[0] if drawn else e["lengths"][0], png, title, device)
    return _attention_lines(plt, e, png, title, device)


def _ideal_value(e, S=None) -> float | None:
    """The 1/P ideal in the figure's unit (ms: one GPU's / P, where known)."""
    if e["metric"] == "x_single":
        return 1.0 / e["P"]
    ref = e["reference"].get(S)
    return ref / e["P"] if ref else None


def _bar_legend(fig, e, ideal, one_gpu: bool):
    """Below the axes, outside the data: ours / anchor fills and the two reference lines."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(facecolor="0.55", label="ours")]
    if any(is_anchor(a) for a in e["algos"]):
        handles.append(Patch(facecolor="0.55", hatch="///", edgecolor="white", label="anchor (external)"))
    if ideal is not None:
        handles.append(Line2D([], [], **IDEAL_STYLE, label="ideal: 1/P of one GPU"))
    if one_gpu:
        handles.append(Line2D([], [], **ONE_GPU_STYLE, label="one GPU (1.0)"))
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.0), ncol=len(handles), fontsize=8,
               frameon=False)


def _attention_bars(plt, e, S, png, title, device):
    algos = e["algos"]
    n = max(len(algos), 1)
    fig, ax = plt.subplots(figsize=(9, 1.9 + 0.38 * n))
    ys = list(range(n))[::-1]                                # the first algorithm on top
    values = [e["points"].get(a, {}).get(S) for a in algos]
    ideal = _ideal_value(e, S)
    finite = [v[0] for v in values if v] + ([ideal] if ideal else [])
    right = max(finite, default=1.0) * 1.32
    for y, algo, v in zip(ys, algos, values):
        if v is None:
            why = e["not_run"].get(algo, {}).get(S) or e["lost"].get(S) or "not run"
            ax.text(right * 0.01, y, _short(why, 95), va="center", ha="left", fontsize=7.5, color="0.35",
                    style="italic", gid=f"not-run:{algo}")
            continue
        value, ms = v
        anchor = is_anchor(algo)
        (bar,) = ax.barh(y, value, height=0.68, color=color(algo), hatch="///" if anchor else None,
                         edgecolor="white" if anchor else color(algo), linewidth=0.0)
        bar.set_gid(f"bar:{algo}")
        text = (f"{value:.3g}  ({_ms(ms)})" if e["metric"] == "x_single" and _finite(ms) else
                f"{value:.3g}" if e["metric"] == "x_single" else _ms(value))
        ax.text(value + right * 0.008, y, text, va="center", ha="left", fontsize=8, gid=f"value:{algo}",
                bbox=_TEXT_BOX, zorder=4)
    ax.set_yticks(ys)
    ax.set_yticklabels([label(a) for a in algos], fontsize=9)
    for tick, algo in zip(ax.get_yticklabels(), algos):
        tick.set_color("0.4" if is_anchor(algo) else "black")
    ax.set_ylim(-0.7, n - 0.3)
    ax.set_xlim(0, right)
    if ideal is not None:
        ax.axvline(ideal, **IDEAL_STYLE, gid="ideal", zorder=3)
        ax.text(ideal, n - 0.3, f" ideal 1/P = {ideal:.3g}", va="bottom", ha="center", fontsize=8)
    one_gpu = e["metric"] == "x_single" and right >= 1.0
    if one_gpu:
        ax.axvline(1.0, **ONE_GPU_STYLE, gid="one-gpu", zorder=3)
        ax.text(1.0, n - 0.3, " one GPU", va="bottom", ha="center", fontsize=8, color="0.35")
    ax.set_xlabel("fwd+bwd time / one GPU's fwd+bwd time on the whole sequence (lower is better)"
                  if e["metric"] == "x_single" else "fwd+bwd time (ms, lower is better)")
    ax.grid(axis="x", color="0.9")
    ax.set_axisbelow(True)
    lengths = f"S = {seq_label(S)} ({S} tokens)"
    ax.set_title(_attention_title(e, title, device, lengths), fontsize=9, loc="left", pad=16)
    _bar_legend(fig, e, ideal, one_gpu)
    fig.tight_layout(rect=(0, 0.4 / fig.get_figheight(), 1, 1))
    fig.savefig(png, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return fig


def _ms(ms: float) -> str:
    """'2071 ms', '453 ms', '27.6 ms', '0.412 ms'."""
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.3g} ms"


def _empty(plt, png: str, title: str):
    """A report without rows: its title and 'no rows' (the figure still replaces an older one)."""
    fig, ax = plt.subplots(figsize=(6, 1.5))
    ax.axis("off")
    ax.text(0.5, 0.5, "no rows in this report", ha="center", va="center")
    ax.set_title(_wrap(title, 90), fontsize=9)
    fig.savefig(png, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return fig


def _leading(v: float) -> float:
    """The leading digit of v > 0 (0.5 -> 5, 30 -> 3)."""
    return round(v / 10 ** math.floor(math.log10(v)), 6) if v > 0 else 0


def _short(text: str, n: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n - 1] + "..."


def _attention_lines(plt, e, png, title, device):
    fig, ax = plt.subplots(figsize=(9.5, 5.2))
    for algo in e["algos"]:
        pts = sorted(e["points"].get(algo, {}).items())
        if not pts:
            continue
        anchor = is_anchor(algo)
        (line,) = ax.plot([s for s, _ in pts], [v for _, (v, _ms) in pts], color=color(algo),
                          linestyle="--" if anchor else "-", marker="s" if anchor else "o",
                          markerfacecolor="white" if anchor else color(algo), markersize=6, linewidth=1.8,
                          label=label(algo))
        line.set_gid(f"line:{algo}")
    ideal = _ideal_value(e)
    if ideal is not None:
        ax.axhline(ideal, **IDEAL_STYLE, gid="ideal", label=f"ideal 1/P = {ideal:.3g}")
    if e["metric"] == "x_single":
        ax.axhline(1.0, **ONE_GPU_STYLE, gid="one-gpu", label="one GPU (1.0)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(e["lengths"])
    ax.set_xticklabels([seq_label(s) for s in e["lengths"]])
    ax.minorticks_off()
    ys = [v for p in e["points"].values() for v, _ in p.values()] + ([ideal, 1.0] if ideal else [])
    if ys and min(ys) > 0 and max(ys) / min(ys) > 6:
        from matplotlib.ticker import FuncFormatter
        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _pos: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _pos: f"{v:g}" if _leading(v) in (2, 3, 5) else ""))
    else:
        ax.set_ylim(0, max(ys, default=1.0) * 1.08)
    ax.set_xlabel("S, tokens in the sequence (log scale)")
    ax.set_ylabel("fwd+bwd time / one GPU's (lower is better)" if e["metric"] == "x_single"
                  else "fwd+bwd time (ms, lower is better)")
    ax.grid(color="0.9")
    ax.set_axisbelow(True)
    lengths = "S = " + ", ".join(seq_label(s) for s in e["lengths"])
    ax.set_title(_attention_title(e, title, device, lengths), fontsize=9, loc="left")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False,
              title="solid: ours\ndashed, open: anchors", title_fontsize=8)
    lengths_of: dict = {}                                   # (algo, reason) -> lengths
    for a, per in e["not_run"].items():
        for s, w in per.items():
            lengths_of.setdefault((a, w), []).append(seq_label(s))
    grouped: dict = {}                                      # (reason, lengths) -> algos
    for (a, w), ss in lengths_of.items():
        grouped.setdefault((w, ", ".join(ss)), []).append(a)
    notes = [f"{', '.join(a)} at {ss}: {_short(w, 80)}" for (w, ss), a in grouped.items()]
    notes += [f"S = {seq_label(s)}: {_short(w, 70)}" for s, w in e["lost"].items()]
    if notes:
        fig.text(0.01, 0.0, _wrap("Not drawn: " + "; ".join(notes), 150), fontsize=7, color="0.35", va="top",
                 gid="not-run-notes")
    fig.tight_layout()
    fig.savefig(png, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return fig


# ----------------------------------------------------------------------------------------------- rank
def rank_entries(rows) -> dict:
    """rank_replay's rows by panel: {(S, "h/h_kv"): {P: [(algo, grid, row), ...]}} in row order."""
    panels: dict = {}
    for r in rows:
        panels.setdefault((r["S"], r["h/h_kv"]), {}).setdefault(r["P"], []).append((r["algo"], r.get("grid", "-"), r))
    return panels


def _heads_label(hk: str) -> str:
    try:
        h, k = (int(x) for x in hk.split("/"))
    except ValueError:
        return f"h/h_kv = {hk}"
    kind = "MHA" if h == k else "MQA" if k == 1 else "GQA"
    return f"h/h_kv = {hk} ({kind})"


def _kv_heads(hk: str) -> int:
    tail = hk.split("/")[-1]
    return int(tail) if tail.isdigit() else 0


def rank_figure(rows, png: str, title: str = "", device: str | None = None):
    """The `rank` bench's figure: per (N, h/h_kv) panel, per P a group of bars, one per algorithm and grid, of
    the slowest rank's fwd+bwd over the ideal (one device's fwd+bwd over the whole sequence / P); 1.0 marked."""
    plt = _pyplot()
    if plt is None:
        _no_matplotlib(png)
        return None
    panels = rank_entries(rows)
    if not panels:
        return _empty(plt, png, title or "rank_replay")
    Ss = sorted({k[0] for k in panels})
    heads = sorted({k[1] for k in panels}, key=_kv_heads, reverse=True)     # MHA's column first
    slots = {k: sum(len(v) + 1 for v in per.values()) for k, per in panels.items()}
    row_h = [max((slots.get((S, hk), 0) for hk in heads), default=1) for S in Ss]
    xs = [r["x_ideal"] for r in rows if _finite(r.get("x_ideal"))]
    right = max(xs + [1.0]) * 1.22
    size = (6.4 * len(heads), 1.0 + sum(0.24 * h + 0.9 for h in row_h))
    fig, axes = plt.subplots(len(Ss), len(heads), figsize=size, squeeze=False, sharex=True,
                             gridspec_kw={"height_ratios": row_h})
    algos = list(dict.fromkeys(r["algo"] for r in rows))
    for i, S in enumerate(Ss):
        for j, hk in enumerate(heads):
            ax = axes[i][j]
            per = panels.get((S, hk))
            if not per:
                ax.set_visible(False)
                continue
            y, ticks, names = 0, [], []
            for P in sorted(per, reverse=True):                # drawn bottom-up: the smallest P on top
                for algo, grid, r in reversed(per[P]):
                    ticks.append(y)
                    names.append(algo if grid in ("-", None) else f"{algo} {grid}")
                    if _finite(r.get("x_ideal")):
                        (bar,) = ax.barh(y, r["x_ideal"], height=0.72, color=color(algo), linewidth=0)
                        bar.set_gid(f"bar:{algo}:{grid}:P{P}:S{S}:{hk}")
                        ax.text(r["x_ideal"] + right * 0.008, y, f"{r['x_ideal']:.2f}", va="center", ha="left",
                                fontsize=7.5, bbox=_TEXT_BOX, zorder=4)
                    else:
                        why = r.get("not_run") or ("no ideal: one device could not run the whole sequence"
                                                   if "fwd_bwd_ms" in r else "not run")
                        ax.text(right * 0.01, y, _short(why, 80), va="center", ha="left", fontsize=7,
                                color="0.35", style="italic", gid=f"not-run:{algo}:{grid}:P{P}:S{S}:{hk}")
                    y += 1
                ax.text(-0.01, y - 0.1, f"P = {P}", transform=ax.get_yaxis_transform(), ha="right", va="center",
                        fontsize=9, fontweight="bold")
                if y < slots[(S, hk)]:
                    ax.axhline(y, color="0.8", linewidth=0.8)
                y += 1
            ax.set_yticks(ticks)
            ax.set_yticklabels(names, fontsize=8)
            ax.set_ylim(-0.7, y - 0.5)
            ax.axvline(1.0, **IDEAL_STYLE, gid="ideal", zorder=3)
            ax.grid(axis="x", color="0.9")
            ax.set_axisbelow(True)
            ax.set_xlim(0, right)
            froms = {r.get("ideal_from") for v in per.values() for _, _, r in v if r.get("ideal_from")}
            src = "" if froms <= {"measured"} else f"; ideal from the {', '.join(sorted(froms - {'measured'}))}"
            ax.set_title(f"N = {seq_label(S)} tokens, {_heads_label(hk)}{src}", fontsize=9.5)
            if i == len(Ss) - 1:
                ax.set_xlabel("slowest rank's fwd+bwd / ideal (lower is better)")
            ax.tick_params(axis="x", labelbottom=True)
    head = title or "rank_replay"
    if device and device not in head:
        head += f" on {device}"
    means = ("1.0 = the ideal: one device's causal fwd+bwd over the whole sequence / P (dashed line); each bar: "
             "the slowest rank of that algorithm, grid and P")
    fig.suptitle(f"{_wrap(head, 95 * len(heads))}\n{_wrap(means, 95 * len(heads))}", fontsize=9.5)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    handles = [Patch(facecolor=color(a), label=a) for a in algos]
    handles.append(Line2D([], [], **IDEAL_STYLE, label="ideal (1.0)"))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 7), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 0.0))
    fig.tight_layout(rect=(0.03, 0.045 if len(handles) <= 7 else 0.07, 1, 1 - 0.12 / fig.get_figheight()))
    fig.savefig(png, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return fig
