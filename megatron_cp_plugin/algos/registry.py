"""What a context-parallel attention algorithm is: one row each, and the one place that lists them.

A row (`Algorithm`) holds everything the rest of the plugin asks of an algorithm: its sequence layout (which
tokens a rank holds; _layout.py places them), so the multiple the sequence length must be (`divisor`), its
family (a --context-parallel-algo value that lets the cost model pick among the family's members, e.g.
`attention2d`), whether it runs on an R x C grid (`--cp-grid`, cp_grid.CPGrid), its implementation and its
cost-model entry, and the line docs and --help show. Everything else is derived from the rows: the flag's
choices (`flag_choices`), `auto`'s candidates (`candidates`), the layouts sharding, RoPE and decoding use
(`layout_of`), the cost model's dispatch, and docs/design.md's table of algorithms (tests/test_registry.py).

Implementations and cost entries are named by "module:function" paths (relative to this package) and
imported on first use, so reading rows (flag parsing, the cost model) imports no algorithm, and no module of
algos/ imports the cost package, which imports this one (tests/test_layering.py). Adding an
algorithm touches its own file, its row here and its cost-model entry; `register` adds one at run time.

The shard-length rule lives here once: `divisor(algo, P)` (2P for zigzag, P for cyclic) and `check_length`.
"""
from __future__ import annotations

import functools
import importlib
import math
from dataclasses import dataclass
from typing import Callable

CHUNKS_PER_RANK = {"zigzag": 2, "cyclic": 1}
"""Each layout _layout.py implements -> the equal chunks of the sequence a rank holds: zigzag holds chunks r and
2P-1-r of 2P, cyclic every P-th token (P chunks of one token per round)."""

DEFAULT_ALGO = "attention2d"
"""--context-parallel-algo when it is not given: in the plugin's own commands (megatron-cp-pretrain, -generate,
megatron-cp-bench) and in `megatron.args.config_from_args` for args without it. Megatron-LM's pretrain_gpt.py has
no default: without the flag it runs without the plugin (`megatron.lm.enabled`)."""

AUTO = "auto"
"""The flag value that asks the cost model for the fastest of every algorithm (of the grid ones with --cp-grid)."""


@dataclass(frozen=True)
class Algorithm:
    """One context-parallel attention algorithm."""

    name: str
    """The --context-parallel-algo value."""
    layout: str
    """Its sequence layout, a key of CHUNKS_PER_RANK."""
    family: str
    """Algorithms of one family differ in schedule only; a family name that is not itself an algorithm is a flag
    value the cost model resolves to the family's fastest member (its first without a model shape)."""
    grid: bool
    """Runs on an R x C grid of ranks (cp_grid.CPGrid; --cp-grid applies)."""
    impl: str | Callable
    """(q, k, v, *, group, causal, softmax_scale, backend, comm_stats, packing) -> o, or its "module:function"
    path; `group` is a CPGrid when `grid`, else a process group."""
    cost: str | Callable
    """The cost-model entry (algo, Problem, Hardware, rank=None) -> cost.Prediction: its bytes per rank
    (equal to its CommStats counters), FLOPs and predicted seconds; or its "module:function" path."""
    description: str
    """One line for docs and --help."""
    baseline: bool = False
    """A benchmark baseline (bench and the cost model run it), not a --context-parallel-algo choice."""
    default_grid: str | Callable | None = None
    """A grid algorithm's grid for a plain group and no --cp-grid: (world, h, h_kv) -> (rows, cols), or its
    "module:function" path; None: cp_grid.choose_grid's (Attention2D's byte-minimising one)."""
    grouped: bool = False
    """Its kernel calls take several chunks at once, up to the grid's cap on query tokens (cp_grid.GROUP_TOKENS,
    CPGrid.group_tokens; --cp-group-tokens applies, and the memory planner chooses it)."""

    def __post_init__(self):
        if self.layout not in CHUNKS_PER_RANK:
            raise ValueError(f"Algorithm {self.name!r}: layout must be one of {tuple(CHUNKS_PER_RANK)}, "
                             f"got {self.layout!r}")

    def divisor(self, world: int) -> int:
        """The multiple the full sequence length must be to shard over `world` ranks in this layout."""
        return CHUNKS_PER_RANK[self.layout] * world

    def grid_shape(self, world: int, h: int = 1, h_kv: int = 1) -> tuple[int, int]:
        """The (rows, cols) this grid algorithm runs on over `world` ranks when none is given."""
        if self.default_grid is not None:
            return _load(self.default_grid)(world, h, h_kv)
        from ..cp_grid import choose_grid  # noqa: PLC0415 (reading rows imports no torch)
        return choose_grid(world, h=h, h_kv=h_kv)

    @property
    def run(self) -> Callable:
        return _load(self.impl)

    @property
    def predict(self) -> Callable:
        return _load(self.cost)


def _load(ref):
    if callable(ref):
        return ref
    return _import(ref)


@functools.lru_cache(maxsize=None)
def _import(ref: str):
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module, __package__), attr)


_ROWS: dict[str, Algorithm] = {}


def register(row: Algorithm) -> Algorithm:
    """Add `row` (a new name: ValueError for one already registered); returns it."""
    if row.name in _ROWS or row.name in flag_choices():
        raise ValueError(f"algorithm {row.name!r} is already a --context-parallel-algo value")
    _ROWS[row.name] = row
    return row


def rows(baselines: bool = False) -> tuple[Algorithm, ...]:
    """The registered algorithms in registration order; the benchmark baselines too when `baselines`."""
    return tuple(r for r in _ROWS.values() if baselines or not r.baseline)


def names(baselines: bool = False) -> tuple[str, ...]:
    return tuple(r.name for r in rows(baselines))


def get(algo: str) -> Algorithm:
    """The row of `algo` (an algorithm or a baseline); ValueError naming algo for anything else."""
    row = _ROWS.get(algo) if isinstance(algo, str) else None
    if row is None:
        raise ValueError(f"algo must be one of {names(baselines=True)}, got {algo!r}")
    return row


def layout_of(algo: str) -> str:
    """The sequence layout of `algo` ("zigzag" or "cyclic"); ValueError for an unknown algo."""
    return get(algo).layout


def families() -> dict[str, tuple[str, ...]]:
    """Family name -> its algorithms, for the families whose name is a flag value of its own (not an algorithm)."""
    out: dict[str, list[str]] = {}
    for r in rows():
        out.setdefault(r.family, []).append(r.name)
    return {f: tuple(m) for f, m in out.items() if f not in _ROWS}


def flag_choices() -> tuple[str, ...]:
    """--context-parallel-algo's values: auto, then every algorithm, each family name before its first member."""
    out, fams = [AUTO], families()
    for r in rows():
        if r.family in fams and r.family not in out:
            out.append(r.family)
        out.append(r.name)
    return tuple(out)


def candidates(flag: str, grid_given: bool = False) -> tuple[str, ...]:
    """The algorithms the cost model chooses among for a model-chosen flag value (`auto`, a family): a family's
    members; with --cp-grid (`grid_given`) only the grid algorithms, which that flag is for."""
    pool = families()[flag] if flag != AUTO else names()
    return tuple(a for a in pool if get(a).grid or not grid_given)


def divisor(algo: str, world: int) -> int:
    """The multiple the full sequence length must be to shard over `world` ranks for `algo` (2P zigzag, P
    cyclic)."""
    return get(algo).divisor(world)


def any_divisor(world: int) -> int:
    """A multiple that every algorithm can shard over `world` ranks (before `auto` has chosen one): 2P today."""
    return math.lcm(*(r.divisor(world) for r in rows()))


def document_unit(algo: str, world: int) -> int:
    """The multiple every packed document's length must be for `algo` over `world` ranks: its divisor; 1 on a
    single rank, where every layout is the identity."""
    return 1 if world == 1 else divisor(algo, world)


def check_length(seq_len: int, algo: str, world: int, what: str) -> None:
    """ValueError naming `what` unless `algo` can shard a sequence of `seq_len` tokens over `world` ranks."""
    div = divisor(algo, world)
    if seq_len % div:
        flag = what.startswith("--")
        raise ValueError(f"{what}{' ' if flag else ' = '}{seq_len} must be divisible by {div} for the "
                         f"{layout_of(algo)} layout of {algo} over {world} ranks")


def unit_words(algo: str, world: int) -> str:
    """" (2 x 4 ranks: the zigzag unit of algo='ring')": what a document-length error says the unit is."""
    chunks = CHUNKS_PER_RANK[layout_of(algo)]
    ranks = f"{chunks} x {world} ranks" if chunks > 1 else f"{world} ranks"
    return f" ({ranks}: the {layout_of(algo)} unit of algo={algo!r})"


# ----------------------------------------------------------------------------------------------- the rows
for _row in (
    Algorithm("ring", "zigzag", "ring", False, ".ring:ring_attention", "..cost.model:ring_family_cost",
              "the zigzag ring, what TransformerEngine's `cp_comm_type=p2p` does"),
    Algorithm("burst", "zigzag", "ring", False, ".burst:burst_attention", "..cost.model:ring_family_cost",
              "BurstAttention (Alg. 1-2): ring forward; the backward keeps K, V and circulates Q, dQ, dO, D, lse"),
    Algorithm("attention2d-no", "cyclic", "attention2d", True, ".attention2d:attention2d_no",
              "..cost.model:attention2d_cost",
              "Attention2D (Alg. 1-3): an R x C grid of GPUs, cyclic tokens, NCCL collectives", grouped=True),
    Algorithm("attention2d-o", "cyclic", "attention2d", True, ".attention2d_o:attention2d_o",
              "..cost.model:attention2d_cost", "the same with overlapped ring communication (Alg. 4-11)",
              grouped=True),
    Algorithm("allgather", "zigzag", "allgather", False, ".allgather:allgather_attention",
              "..cost.collective:allgather_cost",
              "K, V all-gathered, dK, dV summed at their owners: TransformerEngine's `cp_comm_type=all_gather`"),
    Algorithm("ulysses", "zigzag", "ulysses", False, ".ulysses:ulysses_attention", "..cost.collective:ulysses_cost",
              "DeepSpeed-Ulysses: all-to-all from sequence to head shards, local attention, all-to-all back"),
    Algorithm("ulysses-ring", "zigzag", "ulysses-ring", True, ".ulysses_ring:ulysses_ring_attention",
              "..cost.collective:ulysses_ring_cost",
              "USP / LoongTrain: Ulysses inside R x C grid rows of C ranks, the zigzag ring across the R rows",
              default_grid=".ulysses_ring:default_grid"),
    Algorithm("ring-te", "zigzag", "ring", False, ".ring:ring_te_attention", "..cost.model:ring_family_cost",
              "the ring with TransformerEngine's p2p byte budget (dK, dV in the input dtype at every hop)",
              baseline=True),
):
    register(_row)
