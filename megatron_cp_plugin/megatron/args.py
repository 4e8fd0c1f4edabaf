"""Megatron flags for the plugin (an `extra_args_provider`) and the small typed config they map to."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..algos import ALGORITHMS

ALGO_CHOICES = ("ring", "burst", "attention2d") + tuple(a for a in ALGORITHMS if a.startswith("attention2d"))


def add_cp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's `extra_args_provider` shape: adds the plugin's flags and returns the parser."""
    g = parser.add_argument_group("context-parallel attention (megatron-cp-plugin)")
    g.add_argument("--context-parallel-algo", choices=ALGO_CHOICES, default=None,
                   help="context-parallel attention algorithm; attention2d picks the NO variant for now")
    g.add_argument("--cp-grid", default=None, metavar="RxC", help="Attention2D grid, rows x cols = CP size")
    g.add_argument("--cp-gpus-per-node", type=int, default=None, metavar="N",
                   help="GPUs per node: Attention2D keeps grid rows inside a node")
    return parser


@dataclass
class CPConfig:
    """The plugin's settings for one run, checked at start-up (every rank raises the same ValueError)."""

    algo: str
    """Concrete algorithm: one of megatron_cp_plugin.ALGORITHMS ("attention2d" resolved to a variant)."""
    cp_size: int = 1
    """Context-parallel group size (Megatron's --context-parallel-size)."""
    grid: tuple[int, int] | None = None
    """Attention2D grid (rows, cols), rows * cols == cp_size; None: the square or byte-minimising one."""
    gpus_per_node: int | None = None
    """GPUs per node, for Attention2D's node-aware placement; None: column-major placement."""
    seq_length: int | None = None
    """Full sequence length, checked against the layout (2 * cp_size for zigzag, cp_size for cyclic)."""

    def __post_init__(self):
        if self.algo == "attention2d":
            self.algo = "attention2d-no"   # the cost model (issue 8) will choose; NO until then
        if self.algo not in ALGORITHMS:
            raise ValueError(f"--context-parallel-algo must be one of {ALGO_CHOICES}, got {self.algo!r}")
        if self.cp_size < 1:
            raise ValueError(f"--context-parallel-size must be >= 1, got {self.cp_size}")
        if self.grid is not None:
            if not self.algo.startswith("attention2d"):
                raise ValueError(f"--cp-grid is for attention2d, not --context-parallel-algo {self.algo}")
            if self.grid[0] * self.grid[1] != self.cp_size:
                raise ValueError(f"--cp-grid {self.grid[0]}x{self.grid[1]} has {self.grid[0] * self.grid[1]} ranks, "
                                 f"but --context-parallel-size is {self.cp_size}")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise ValueError(f"--cp-gpus-per-node must be >= 1, got {self.gpus_per_node}")
        if self.seq_length is not None:
            div = self.cp_size if self.algo.startswith("attention2d") else 2 * self.cp_size
            if self.seq_length % div:
                raise ValueError(f"--seq-length {self.seq_length} must be divisible by {div} for "
                                 f"--context-parallel-algo {self.algo} with --context-parallel-size {self.cp_size}")


def parse_grid(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        r, c = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--cp-grid must look like RxC (e.g. 2x4), got {text!r}") from None
    return r, c


def config_from_args(args) -> CPConfig:
    """CPConfig from Megatron-style parsed args (context_parallel_algo, context_parallel_size, cp_grid, ...)."""
    return CPConfig(algo=args.context_parallel_algo or "ring", cp_size=getattr(args, "context_parallel_size", 1),
                    grid=parse_grid(getattr(args, "cp_grid", None)), gpus_per_node=getattr(args, "cp_gpus_per_node", None),
                    seq_length=getattr(args, "seq_length", None))


def resolve_algo(args) -> str:
    """The concrete algorithm for parsed args (`attention2d` -> its variant)."""
    return config_from_args(args).algo
