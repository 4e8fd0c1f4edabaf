"""Moving between full and sharded tensors in an algorithm's layout, and padding packed documents to its unit.

Which tokens each rank holds (the zigzag and cyclic layouts, per document with `cu_seqlens`) is defined once,
below the algorithms that use it too, in algos/_layout.py: `sequence_positions`, `layout_positions`,
`document_offsets`, `document_unit` are re-exported here, where users and the integration import them.
`shard_sequence` / `unshard_sequence` index by those positions; `pad_documents` pads a data loader's documents
to the layout's unit.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .algos import registry
# The positions are defined below the algorithms (algos/_layout.py), which use them too; re-exported here.
from .algos._layout import (algo_documents, document_offsets, document_unit, layout_positions,  # noqa: F401
                            sequence_positions)
from .comm import resolve_group, run_collective


def shard_sequence(x: torch.Tensor, *, algo: str, group=None, dim: int = 1, cu_seqlens=None) -> torch.Tensor:
    """This rank's shard of the full tensor `x` (same on every rank) along `dim`, in the layout of `algo`; with
    `cu_seqlens` (packed documents along `dim`) each document in that layout."""
    group = resolve_group(group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if cu_seqlens is None:
        registry.check_length(x.shape[dim], algo, world, f"x.shape[{dim}]")
    pos = sequence_positions(x.shape[dim], algo=algo, rank=rank, world_size=world, cu_seqlens=cu_seqlens)
    return x.index_select(dim, pos.to(x.device))


def unshard_sequence(x: torch.Tensor, *, algo: str, group=None, dim: int = 1, cu_seqlens=None) -> torch.Tensor:
    """All-gather every rank's shard `x` along `dim` and put the tokens back in sequence order (`cu_seqlens`:
    as given to `shard_sequence`)."""
    group = resolve_group(group)
    world = dist.get_world_size(group)
    registry.get(algo)
    seq_len = x.shape[dim] * world
    pos = torch.cat([sequence_positions(seq_len, algo=algo, rank=r, world_size=world, cu_seqlens=cu_seqlens)
                     for r in range(world)])                 # validated before the collective
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(world)]
    run_collective(dist.all_gather, parts, x.contiguous(), group=group)   # see run_collective: exit safety
    gathered = torch.cat(parts, dim)
    return torch.empty_like(gathered).index_copy_(dim, pos.to(x.device), gathered)


# ------------------------------------------------------------------------------------------- padding
def pad_documents(cu_seqlens, unit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(padded cu_seqlens int32 [n_docs + 1], index LongTensor [total]): every document padded at its end to a
    multiple of `unit` (`document_unit(algo, P)`); `index` is each original token's place in the padded
    sequence. Padding after a document's last token leaves causal attention of its real tokens unchanged;
    give the pads no loss (see `pad_packed`)."""
    if unit < 1:
        raise ValueError(f"unit must be a positive integer, got {unit}")
    offs = torch.tensor(document_offsets(cu_seqlens), dtype=torch.long)
    lens = offs[1:] - offs[:-1]
    padded = (lens + unit - 1) // unit * unit
    new = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(padded, 0)])
    doc = torch.repeat_interleave(torch.arange(len(lens)), lens)
    index = torch.arange(int(offs[-1])) - offs[:-1][doc] + new[:-1][doc]
    return new.to(torch.int32), index


def pad_packed(x: torch.Tensor, cu_seqlens, unit: int, *, dim: int = 1, value=0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x with every document padded to a multiple of `unit` along `dim` by `value`, padded cu_seqlens int32).
    Pad tokens, labels with anything, the loss mask with 0; position ids of pads do not matter."""
    new, index = pad_documents(cu_seqlens, unit)
    if x.shape[dim] != index.numel():
        raise ValueError(f"x.shape[{dim}] = {x.shape[dim]} must equal cu_seqlens[-1] = {index.numel()}")
    shape = list(x.shape)
    shape[dim] = int(new[-1])
    return x.new_full(shape, value).index_copy_(dim, index.to(x.device), x), new
