"""Hierarchical all-to-all + ring attention: USP (Fang and Zhao 2024, *USP: A Unified Sequence Parallelism
Approach for Long Context Generative AI*) and LoongTrain (Gu et al. 2024, *LoongTrain: Efficient Training of
Long-Sequence LLMs with Head-Context Parallelism*), TransformerEngine's `cp_comm_type=a2a+p2p`.

The P ranks form an R x C grid (cp_grid.CPGrid; `--cp-grid RxC`): C = U consecutive ranks run the Ulysses
all-to-all over heads among themselves (`ulysses.py`: inside a node, where all-to-all is cheap), and the R = P / U
ranks with the same index in their group run the zigzag ring (`ring.py`) across the groups, on the head-sharded
tensors. Tokens are zigzag over the P ranks, so group g (ranks gU .. gU + U - 1) holds chunks gU .. gU + U - 1 and
their mirrors: super-chunks g and 2R-1-g of the sequence cut into 2R, which after the all-to-all is a zigzag shard
of the group-level sequence, exactly what the ring balances. U = P is Ulysses, U = 1 the ring (with the heads
not split). The grid's placement is not used: the groups are always consecutive ranks (the row-major grid of
the same shape); a plain group gets `default_grid`'s shape. The q heads must allow an all-to-all over U ranks
(`ulysses.check_heads`: h % U == 0), else a ValueError before any collective; each member gets the K, V heads its
q heads read (any h_kv: `ulysses.kv_spans`), so members j of all groups, the ranks of one ring, hold the same
number, and where its q heads per K, V head vary the ring runs once per uniform segment (`ulysses.head_segments`:
each K, V head still travels the ring once).
Packed sequences: the group-level rows are the zigzag shard of every document over the R groups (in
`Packing.zigzag_order` when causal), as the ring takes them.

Design notes (looked up, not copied): yunchang's `LongContextAttention` (USP) and TransformerEngine's a2a+p2p
(`--hierarchical-context-parallel-sizes`) put the all-to-all inside and the ring across, as here; LoongTrain's
double ring is not used (one ring across the groups).

Bytes sent per rank and call (e, s = s_local; k_j the K, V heads of its member index j in the group and
K = k_0 + .. + k_{U-1}, as in `ulysses.py`; n' = b * U * s * k_j * d, acc = 4; 8 fp64):
  forward  (U - 1) * b * s * d * e * 2 h / U + 2 * b * s * d * e * (K - k_j) + (R - 1) * 2 * n' * e
  backward (U - 1) * b * s * d * e * (2 h / U + 2 k_j) + (R - 1) * 2 * n' * (e + acc)
(with every k_j = k, h_kv / U or 1 where U divides h_kv or h_kv divides U, the all-to-all terms are both
(U - 1) * b * s * d * e * (2 h / U + 2 k)).
"""
from __future__ import annotations


from ..comm import CommStats
from ..cp_grid import CPGrid, get_grid
from .ulysses import HeadsPlan, check_heads, run_heads

MAX_ULYSSES = 8
"""The largest all-to-all `default_grid` picks: the GPUs of one HGX node."""


def _heads_allow(h: int, h_kv: int, u: int) -> bool:
    return h % u == 0                                  # any h_kv: ulysses.kv_spans


def default_grid(world: int, h: int, h_kv: int) -> tuple[int, int]:
    """(R, U) for a plain group: the largest all-to-all the heads allow among the divisors of P up to
    MAX_ULYSSES (one node), the ring across the rest; U = 1 (the ring alone) always fits."""
    u = max(x for x in range(1, min(world, MAX_ULYSSES) + 1) if world % x == 0 and _heads_allow(h, h_kv, x))
    return world // u, u


def ulysses_ring_attention(q, k, v, *, group: CPGrid, causal: bool = True, softmax_scale: float,
                           backend: str | None = None, comm_stats: CommStats | None = None, packing=None):
    """All-to-all over heads in grid rows of U = group.cols consecutive ranks, the zigzag ring over the
    R = group.rows groups, on validated zigzag shards: q [b, s, h, d], k, v [b, s, h_kv, d] -> [b, s, h, d]."""
    R, U = group.rows, group.cols
    check_heads("ulysses-ring", q.shape[2], k.shape[2], U)          # before any collective
    grid = group if group.row_major else get_grid(group.group, (R, U), gpus_per_node=U)
    plan = HeadsPlan(grid.row, U, grid.j, tuple(grid.row_ranks), grid.world, k.shape[2],
                     ring=grid.col, groups=R, ring_rank=grid.i)
    return run_heads(plan, q, k, v, causal, softmax_scale, backend, comm_stats, packing)
