"""Which tokens each context-parallel rank holds, and moving between full and sharded tensors.

Layouts:
  zigzag (ring, burst; Megatron's own): the sequence is cut into 2P chunks and rank r holds chunks r and
         2P-1-r, in that order, so every rank does the same causal work. Megatron's
         `get_batch_on_this_cp_rank` and RoPE slicer assume exactly this.
  cyclic (attention2d-*): token t lives on rank t mod P (rank = rank in the CP group), in token order.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .algos import layout_of
from .comm import resolve_group


def _divisor(layout: str, world_size: int) -> int:
    return 2 * world_size if layout == "zigzag" else world_size


def _check_len(seq_len: int, layout: str, world_size: int, what: str) -> None:
    div = _divisor(layout, world_size)
    if seq_len % div != 0:
        raise ValueError(f"{what} = {seq_len} must be divisible by {div} for the {layout} layout over "
                         f"{world_size} ranks")


def sequence_positions(seq_len: int, *, algo: str, rank: int, world_size: int) -> torch.Tensor:
    """LongTensor [seq_len // world_size]: the global token index of each local row of `rank`."""
    layout = layout_of(algo)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    _check_len(seq_len, layout, world_size, "seq_len")
    if layout == "cyclic":
        return torch.arange(rank, seq_len, world_size)
    c = seq_len // (2 * world_size)
    first = torch.arange(rank * c, (rank + 1) * c)
    return torch.cat([first, first + (2 * world_size - 1 - 2 * rank) * c])


def shard_sequence(x: torch.Tensor, *, algo: str, group=None, dim: int = 1) -> torch.Tensor:
    """This rank's shard of the full tensor `x` (same on every rank) along `dim`, in the layout of `algo`."""
    group = resolve_group(group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    layout = layout_of(algo)
    _check_len(x.shape[dim], layout, world, f"x.shape[{dim}]")
    pos = sequence_positions(x.shape[dim], algo=algo, rank=rank, world_size=world).to(x.device)
    return x.index_select(dim, pos)


def unshard_sequence(x: torch.Tensor, *, algo: str, group=None, dim: int = 1) -> torch.Tensor:
    """All-gather every rank's shard `x` along `dim` and put the tokens back in sequence order."""
    group = resolve_group(group)
    world = dist.get_world_size(group)
    layout_of(algo)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    seq_len = x.shape[dim] * world
    pos = torch.cat([sequence_positions(seq_len, algo=algo, rank=r, world_size=world) for r in range(world)])
    gathered = torch.cat(parts, dim)
    return torch.empty_like(gathered).index_copy_(dim, pos.to(x.device), gathered)
