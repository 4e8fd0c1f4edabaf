"""Each algorithm's per-rank compute in the cost model, from one-GPU measurements of its local work (issue 26).

model.py times a rank's compute from FLOPs at the kernel's rate plus modelled merges and accumulator adds.
The local work that really runs (kernel calls per block pair, casts, copies, merges; `megatron-cp-bench rank`,
bench/rank_replay.py) costs each algorithm a different amount more than that. The benchmark measures, per
algorithm, grid and P, the rank's fwd+bwd time over the ideal (one GPU's causal attention over the whole
sequence / P, timed in the same run), and divides it by the model's own ratio for that rank (its compute-only
prediction over the ideal at its kernel rates): the factor, independent of which GPU ran it. `scaled` divides a
Hardware's compute rates (kernel TFLOP/s and memory bandwidth) by the factor, so that the model's compute of that
algorithm is the measured one and its communication is untouched.

The factors live in megatron_cp_plugin/configs/rank_compute.json (`megatron-cp-bench rank --fit-out` writes it).
Default, until GPU numbers are committed there: no factors, i.e. 1.0 for every algorithm (the analytic compute).
Lookup: "<algo> <R>x<C>" for the exact Attention2D grid, else "<algo>"; the measured P nearest in log2 (ties to
the smaller); 1.0 when the algorithm has none.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
from pathlib import Path

FIT_PATH = Path(__file__).resolve().parents[1] / "configs" / "rank_compute.json"   # megatron_cp_plugin/configs
_ENABLED = [True]


@functools.lru_cache(maxsize=None)
def load(path: str | None = None) -> dict:
    """The fit file's factors: {key: {P: factor}} (an empty dict when the file lists none)."""
    p = Path(path) if path is not None else FIT_PATH
    if not p.is_file():
        return {}
    with open(p) as f:
        data = json.load(f)
    out = {}
    for key, per_p in data.get("factors", {}).items():
        for P, x in per_p.items():
            if not (isinstance(x, (int, float)) and x > 0 and math.isfinite(x)):
                raise ValueError(f"{p}: factors[{key!r}][{P!r}] must be a positive number, got {x!r}")
        out[key] = {int(P): float(x) for P, x in per_p.items()}
    return out


def factor(algo: str, world: int, grid: tuple[int, int] | None = None, path: str | None = None) -> float:
    """The measured compute factor of `algo` at `world` ranks (Attention2D: on `grid`), 1.0 without one."""
    table = load(path)
    per_p = (table.get(f"{algo} {grid[0]}x{grid[1]}") if grid else None) or table.get(algo)
    if not per_p or not _ENABLED[0]:
        return 1.0
    best = min(per_p, key=lambda P: (abs(math.log2(P) - math.log2(max(world, 1))), P))
    return per_p[best]


def scaled(algo: str, pb, hw):
    """hw with its compute rates divided by `algo`'s factor for problem pb (model.Problem)."""
    grid = pb.attention2d_grid() if algo.startswith("attention2d") else None
    x = factor(algo, pb.world, grid)
    if x == 1.0:
        return hw
    return dataclasses.replace(hw, fwd_tflops=hw.fwd_tflops / x, bwd_tflops=hw.bwd_tflops / x, mem_bw=hw.mem_bw / x)


@contextlib.contextmanager
def disabled():
    """The analytic compute (every factor 1.0) inside the block: what the benchmark fits the factors against."""
    _ENABLED[0] = False
    try:
        yield
    finally:
        _ENABLED[0] = True
