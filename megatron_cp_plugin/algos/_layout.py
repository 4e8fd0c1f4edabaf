"""Which tokens each context-parallel rank holds: the one definition of the layouts' positions.

Layouts (which algorithm uses which: its row in registry.py):
  zigzag (ring, burst, allgather, ulysses, ulysses-ring; Megatron's own): the sequence is cut into 2P chunks and
         rank r holds chunks r and 2P-1-r, in that order, so every rank does the same causal work. Megatron's
         `get_batch_on_this_cp_rank` and RoPE slicer assume exactly this.
  cyclic (attention2d-*): token t lives on rank t mod P (rank = rank in the CP group), in token order.

Packed sequences (`cu_seqlens`, int32 [n_docs + 1]: the cumulative document boundaries of the whole packed
sequence, the same on every rank): each document is laid out on its own, and a rank holds its part of document
0, then of document 1, ... So the local sequence is itself packed, with boundaries cu_seqlens / P. Zigzag per
document is TransformerEngine's THD layout (`thd_get_partitioned_indices`). Every document length must be a
multiple of the layout's unit (`document_unit`: 2P zigzag, P cyclic; 1 on one rank); `pad_documents`
(sharding.py) pads a data loader's documents to it.

This module sits below the algorithms, which import it (packed offsets checked against their unit, Ulysses'
reordering); sharding.py re-exports its public names and moves tensors by them. It imports only the registry:
nothing under algos/ imports sharding.py or the cost model (tests/test_layering.py).
"""
from __future__ import annotations

import functools

import torch

from . import registry


def document_unit(algo: str, world_size: int) -> int:
    """The multiple every packed document's length must be for `algo` over `world_size` ranks: 2P (zigzag), P
    (cyclic); 1 on a single rank, where every layout is the identity."""
    return registry.document_unit(algo, world_size)


def algo_documents(cu_seqlens, *, algo: str, world_size: int, total: int | None = None) -> tuple[int, ...]:
    """`document_offsets` checked against `algo`'s document unit over `world_size` ranks."""
    return document_offsets(cu_seqlens, unit=document_unit(algo, world_size), total=total,
                            why=registry.unit_words(algo, world_size))


def document_offsets(cu_seqlens, *, unit: int = 1, total: int | None = None, why: str = "") -> tuple[int, ...]:
    """`cu_seqlens` (a 1-D integer tensor or sequence: 0, then non-decreasing cumulative lengths) as host ints,
    checked: every document's length a multiple of `unit`, the last boundary `total` when given. ValueError
    naming cu_seqlens otherwise; `why` names the unit in the message. A CUDA tensor costs one device sync."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor [n_docs + 1], got {cu_seqlens.dtype} "
                             f"{tuple(cu_seqlens.shape)}")
        offs = tuple(int(x) for x in cu_seqlens.tolist())
    elif isinstance(cu_seqlens, tuple) and all(type(x) is int for x in cu_seqlens):
        offs = cu_seqlens                                        # host ints already (the fast path per layer)
    else:
        try:
            offs = tuple(int(x) for x in cu_seqlens)
        except TypeError:
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor [n_docs + 1], got {type(cu_seqlens).__name__}") \
                from None
    return _checked(offs, unit, total, why)


@functools.lru_cache(maxsize=64)
def _checked(offs: tuple[int, ...], unit: int, total: int | None, why: str) -> tuple[int, ...]:
    """document_offsets' checks, once per (boundaries, unit): every layer of a model sees the same packing."""
    if len(offs) < 2 or offs[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0 and hold at least one document, got {list(offs[:8])}")
    for i in range(len(offs) - 1):
        n = offs[i + 1] - offs[i]
        if n < 0:
            raise ValueError(f"cu_seqlens must be non-decreasing: document {i} has length {n}")
        if n % unit:
            raise ValueError(f"cu_seqlens: document {i} (tokens {offs[i]}..{offs[i + 1] - 1}) has length {n}, not a "
                             f"multiple of {unit}{why}; pad each document to a multiple of {unit} "
                             f"(megatron_cp_plugin.pad_documents)")
    if total is not None and offs[-1] != total:
        raise ValueError(f"cu_seqlens[-1] = {offs[-1]} must equal the packed sequence length {total}")
    return offs


def _packed_positions(offs: tuple[int, ...], layout: str, rank: int, world: int) -> torch.Tensor:
    """Global token index of each local row: document by document, each in `layout`, on `rank` of `world`."""
    offs_t = torch.tensor(offs, dtype=torch.long)
    lens = offs_t[1:] - offs_t[:-1]
    local = lens // world                                      # rows per document on every rank
    doc = torch.repeat_interleave(torch.arange(len(lens)), local)
    k = torch.arange(int(local.sum())) - (torch.cumsum(local, 0) - local)[doc]   # row within its document
    if world == 1:
        pos = k
    elif layout == "cyclic":
        pos = rank + k * world
    else:                                                      # chunks r and 2P-1-r of the document
        half = (local // 2)[doc]
        pos = torch.where(k < half, rank * half + k, (2 * world - 1 - rank) * half + (k - half))
    return offs_t[:-1][doc] + pos


def sequence_positions(seq_len: int, *, algo: str, rank: int, world_size: int, cu_seqlens=None) -> torch.Tensor:
    """LongTensor [seq_len // world_size]: the global token index of each local row of `rank` in `algo`'s layout.
    With `cu_seqlens` (int32 [n_docs + 1], cu_seqlens[-1] == seq_len) every document is laid out on its own."""
    if cu_seqlens is not None:
        cu_seqlens = algo_documents(cu_seqlens, algo=algo, world_size=world_size, total=seq_len)
    else:
        registry.check_length(seq_len, algo, world_size, "seq_len")
    return layout_positions(seq_len, registry.layout_of(algo), rank=rank, world_size=world_size,
                            cu_seqlens=cu_seqlens)


def layout_positions(seq_len: int, layout: str, *, rank: int, world_size: int, cu_seqlens=None) -> torch.Tensor:
    """`sequence_positions` of a layout ("zigzag", "cyclic": registry.CHUNKS_PER_RANK) rather than of an algorithm:
    for what follows a layout whatever the algorithm (Megatron's THD RoPE reads zigzag rows: megatron/rope.py)."""
    if layout not in registry.CHUNKS_PER_RANK:
        raise ValueError(f"layout must be one of {tuple(registry.CHUNKS_PER_RANK)}, got {layout!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    div = registry.CHUNKS_PER_RANK[layout] * world_size
    if cu_seqlens is not None:
        offs = document_offsets(cu_seqlens, unit=div if world_size > 1 else 1, total=seq_len)
        return _packed_positions(offs, layout, rank, world_size)
    if seq_len % div:
        raise ValueError(f"seq_len = {seq_len} must be divisible by {div} for the {layout} layout over {world_size} "
                         f"ranks")
    if layout == "cyclic":
        return torch.arange(rank, seq_len, world_size)
    c = seq_len // (2 * world_size)
    first = torch.arange(rank * c, (rank + 1) * c)
    return torch.cat([first, first + (2 * world_size - 1 - 2 * rank) * c])
