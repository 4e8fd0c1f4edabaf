"""Megatron flags for the plugin (an `extra_args_provider`) and the small typed config they map to.

`--context-parallel-algo auto` (and `attention2d`, which picks attention2d-no or -o) is resolved at start-up,
in `CPConfig`, by the cost model (`megatron_cp_plugin.cost.choose_algo`) from the model's shape, the CP
size and `--cp-hardware`; rank 0 prints the choice and the predicted times in one line.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

from ..algos import registry
from ..cp_grid import GROUP_TOKENS, check_group_tokens
from ..cost import HARDWARE, Problem, best_grid, choose_algo

DEFAULT_HARDWARE = "h200-nvlink"


def _algo_help() -> str:
    fams = "; ".join(f"{f}: the faster of {', '.join(m)} by the cost model" for f, m in registry.families().items())
    return ("context-parallel attention algorithm; auto: the cost model's fastest for this model, CP size and "
            f"--cp-hardware{'; ' + fams if fams else ''}")


def add_cp_args(parser: argparse.ArgumentParser, default: str | None = None) -> argparse.ArgumentParser:
    """Megatron's `extra_args_provider` shape: adds the plugin's flags and returns the parser. `default`: the
    --context-parallel-algo of a run without the flag (None in Megatron-LM: the plugin stays off; the plugin's
    own commands pass registry.DEFAULT_ALGO)."""
    g = parser.add_argument_group("context-parallel attention (megatron-cp-plugin)")
    g.add_argument("--context-parallel-algo", choices=registry.flag_choices(), default=default,
                   help=_algo_help())
    g.add_argument("--cp-grid", default=None, metavar="RxC",
                   help="grid of the grid algorithms, rows x cols = CP size: Attention2D's; ulysses-ring's R rings "
                        "across groups of C consecutive ranks that run the all-to-all")
    g.add_argument("--cp-group-tokens", type=int, default=None, metavar="N",
                   help=f"Attention2D: the most query tokens one grouped kernel call takes (larger calls are "
                        f"faster locally and need more memory; default: {GROUP_TOKENS[0]}, except for shards "
                        f"{GROUP_TOKENS[-1]} would not group, which keep one chunk pair a call overlapped with the "
                        f"gathers; {GROUP_TOKENS[-1]} where the memory planner finds no room for the larger calls)")
    g.add_argument("--cp-gpus-per-node", type=int, default=None, metavar="N",
                   help="GPUs per node: Attention2D keeps grid rows inside a node")
    # default None (= DEFAULT_HARDWARE) so that the choice line knows whether the user asked for a cluster
    g.add_argument("--cp-hardware", choices=sorted(HARDWARE), default=None,
                   help=f"the cluster the cost model assumes for auto / attention2d (cost.HARDWARE; default "
                        f"{DEFAULT_HARDWARE}; --cp-gpus-per-node overrides its GPUs per node)")
    return parser


@dataclass
class CPConfig:
    """The plugin's settings for one run, checked at start-up (every rank raises the same ValueError)."""

    algo: str
    """Algorithm: one of megatron_cp_plugin.ALGORITHMS after construction; "auto" and "attention2d" are resolved
    by the cost model (attention2d without a model shape: attention2d-no)."""
    cp_size: int = 1
    """Context-parallel group size (Megatron's --context-parallel-size)."""
    grid: tuple[int, int] | None = None
    """Attention2D grid (rows, cols), rows * cols == cp_size; None: the cost model's fastest when it chose the
    algorithm (auto, attention2d), else cp_grid.choose_grid's (the square or byte-minimising one)."""
    gpus_per_node: int | None = None
    """GPUs per node, for Attention2D's node-aware placement; None: column-major placement."""
    group_tokens: int | None = None
    """Attention2D's cap on the query tokens of one grouped kernel call (cp_grid.GROUP_TOKENS); None: its default rule
    (megatron-cp-pretrain's memory check sets the smallest cap where the rule's calls do not fit)."""
    seq_length: int | None = None
    """Full sequence length, checked against the layout (2 * cp_size for zigzag, cp_size for cyclic)."""
    heads: int | None = None
    """Query heads per tensor-parallel rank (the cost model's input; needed by auto)."""
    kv_heads: int | None = None
    """Key/value heads per tensor-parallel rank; None: heads."""
    head_dim: int | None = None
    """Head dimension; None: 128."""
    micro_batch: int = 1
    """Sequences per attention call."""
    dtype_bytes: int = 2
    """Element size of q, k, v (2 for bf16/fp16, 4 for fp32)."""
    hardware: str = DEFAULT_HARDWARE
    """cost.HARDWARE preset the cost model assumes."""
    requested: str | None = None
    """The flag value before resolution ("auto" or "attention2d"); None when a concrete algo was given."""
    predicted: dict | None = None
    """Predicted seconds per candidate (fwd + bwd of one layer's attention) when the cost model chose."""
    hardware_given: bool = True
    """Whether --cp-hardware was given: without it and without a GPU here, the choice line prints no GPU times."""

    def __post_init__(self):
        if self.algo not in registry.flag_choices():
            raise ValueError(f"--context-parallel-algo must be one of {registry.flag_choices()}, got {self.algo!r}")
        if not isinstance(self.cp_size, int) or self.cp_size < 1:
            raise ValueError(f"--context-parallel-size must be >= 1, got {self.cp_size}")
        if self.grid is not None and self.grid[0] * self.grid[1] != self.cp_size:
            raise ValueError(f"--cp-grid {self.grid[0]}x{self.grid[1]} has {self.grid[0] * self.grid[1]} ranks, "
                             f"but --context-parallel-size is {self.cp_size}")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise ValueError(f"--cp-gpus-per-node must be >= 1, got {self.gpus_per_node}")
        if self.group_tokens is not None:
            check_group_tokens(self.group_tokens)
        if self.hardware not in HARDWARE:
            raise ValueError(f"--cp-hardware must be one of {sorted(HARDWARE)}, got {self.hardware!r}")
        if self.algo not in registry.names():
            self.requested = self.algo
            self.algo, self.predicted = self._choose()
        if self.grid is not None and not registry.get(self.algo).grid:
            grid_algos = ", ".join(r.name for r in registry.rows() if r.grid)
            raise ValueError(f"--cp-grid is for the grid algorithms ({grid_algos}), not --context-parallel-algo "
                             f"{self.algo}")
        if self.group_tokens is not None and self.requested is None and not registry.get(self.algo).grouped:
            grouped = ", ".join(r.name for r in registry.rows() if r.grouped)
            raise ValueError(f"--cp-group-tokens is for the algorithms with grouped kernel calls ({grouped}), not "
                             f"--context-parallel-algo {self.algo}")
        if self.seq_length is not None:
            registry.check_length(self.seq_length, self.algo, self.cp_size, "--seq-length")

    def _choose(self) -> tuple[str, dict | None]:
        """(algo, predicted seconds per candidate) for "auto" or a family ("attention2d") by the cost model."""
        # --cp-grid only makes sense for the grid algorithms, so auto then chooses among them.
        cands = registry.candidates(self.requested, grid_given=self.grid is not None)
        if not cands:
            raise ValueError(f"--context-parallel-algo {self.requested}: none of its algorithms takes --cp-grid")
        if self.seq_length is None or self.heads is None:
            if self.requested != registry.AUTO:
                return cands[0], None          # no model shape: the family's first (attention2d-no: NCCL's)
            raise ValueError("--context-parallel-algo auto needs the model shape (--seq-length and "
                             "--num-attention-heads) to choose an algorithm")
        if self.seq_length % self.cp_size:
            raise ValueError(f"--seq-length {self.seq_length} must be divisible by --context-parallel-size "
                             f"{self.cp_size}")
        hw = HARDWARE[self.hardware]
        if self.gpus_per_node is not None:
            hw = dataclasses.replace(hw, gpus_per_node=self.gpus_per_node)
        pb = Problem(self.seq_length, self.cp_size, self.heads, self.kv_heads, self.head_dim or 128,
                     self.micro_batch, self.dtype_bytes, grid=self.grid, node_aware=self.gpus_per_node is not None,
                     group_tokens=self.group_tokens)
        algo, times = choose_algo(pb, hw, cands)
        if registry.get(algo).grid and self.grid is None:
            self.grid = best_grid(algo, pb, hw)        # the grid its predicted time was for
        return algo, times

    def choice_line(self) -> str | None:
        """One line saying what the cost model chose and its predicted times (None for a concrete --algo)."""
        if self.requested is None or self.cp_size == 1:       # CP = 1: attention is local, nothing was chosen
            return None
        head = f"megatron-cp-plugin: --context-parallel-algo {self.requested} -> {self.algo}"
        if self.predicted is None:
            return head + " (no model shape given: the cost model was not consulted)"
        if not self.hardware_given and not _have_gpu():
            grid = f", grid {self.grid[0]}x{self.grid[1]}" if self.grid else ""
            return (f"{head} (CP {self.cp_size}, seq {self.seq_length}{grid}: the cost model's choice for "
                    f"{self.hardware} GPUs, the default --cp-hardware; its predicted GPU times are not printed on "
                    f"a machine without a GPU unless --cp-hardware is given)")
        times = ", ".join(f"{a} {t * 1e3:.3g} ms" for a, t in sorted(self.predicted.items(), key=lambda x: x[1]))
        grid = f", grid {self.grid[0]}x{self.grid[1]}" if self.grid else ""
        return (f"{head} (CP {self.cp_size}, seq {self.seq_length}, heads {self.heads}/{self.kv_heads or self.heads}, "
                f"head dim {self.head_dim or 128}, micro-batch {self.micro_batch}, {self.dtype_bytes}-byte elements, "
                f"{self.hardware}{grid}); predicted attention fwd+bwd per layer: {times}")


def parse_grid(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        r, c = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--cp-grid must look like RxC (e.g. 2x4), got {text!r}") from None
    return r, c


def _model_shape(args) -> dict:
    """Heads, KV heads and head dim per tensor-parallel rank, micro-batch and element size from Megatron-style
    args (Megatron-LM sets num_query_groups = 1 unless --group-query-attention; ours leaves it None for MHA)."""
    heads = getattr(args, "num_attention_heads", None)
    if not heads:
        return {}
    tp = getattr(args, "tensor_model_parallel_size", None) or 1
    groups = getattr(args, "num_query_groups", None)
    if not groups or not getattr(args, "group_query_attention", True):
        groups = heads
    hidden = getattr(args, "hidden_size", None)
    head_dim = getattr(args, "kv_channels", None) or (hidden // heads if hidden else None)
    half = getattr(args, "bf16", False) or getattr(args, "fp16", False)
    return dict(heads=max(1, heads // tp), kv_heads=max(1, groups // tp), head_dim=head_dim,
                micro_batch=getattr(args, "micro_batch_size", None) or 1, dtype_bytes=2 if half else 4)


_LOGGED: set = set()


def _have_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _is_rank0() -> bool:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def log_choice(cfg: CPConfig) -> None:
    """Print cfg.choice_line() on rank 0, once per process for a given line (resolve_algo runs per batch)."""
    line = cfg.choice_line()
    if line is not None and line not in _LOGGED and _is_rank0():
        _LOGGED.add(line)
        print(line, flush=True)


def config_from_args(args, log: bool = True) -> CPConfig:
    """CPConfig from Megatron-style parsed args (context_parallel_algo, context_parallel_size, cp_grid, the model
    shape for auto, ...); logs the cost model's choice on rank 0 when it made one (and `log`)."""
    cfg = CPConfig(algo=args.context_parallel_algo or registry.DEFAULT_ALGO,
                   cp_size=getattr(args, "context_parallel_size", 1) or 1,
                   grid=parse_grid(getattr(args, "cp_grid", None)),
                   gpus_per_node=getattr(args, "cp_gpus_per_node", None),
                   group_tokens=getattr(args, "cp_group_tokens", None), seq_length=getattr(args, "seq_length", None),
                   hardware=getattr(args, "cp_hardware", None) or DEFAULT_HARDWARE,
                   hardware_given=getattr(args, "cp_hardware", None) is not None, **_model_shape(args))
    if log:
        log_choice(cfg)
    return cfg


def resolve_algo(args) -> str:
    """The concrete algorithm for parsed args (`auto`, `attention2d` -> the cost model's choice)."""
    return config_from_args(args).algo
