"""A packed sequence's documents as the algorithms see them: validated once by the entry point, then passed down.

Each document is laid out on its own (zigzag for ring and burst, cyclic for Attention2D), so every rank holds
1/P of every document, in document order: the local shard is packed with boundaries cu_seqlens / P.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..kernels.segments import Segments, to_device


@dataclass(frozen=True)
class Packing:
    """The documents of a packed sequence, validated by the entry point (every length a multiple of the
    layout's unit), as the algorithms over `world` ranks see them."""

    offsets: tuple[int, ...]
    """cu_seqlens of the whole packed sequence, host ints (the same on every rank)."""
    world: int
    """Ranks in the context-parallel group."""

    @staticmethod
    @functools.lru_cache(maxsize=16)
    def of(offsets: tuple[int, ...], world: int) -> "Packing":
        """The Packing of (offsets, world), one object per packing, so that its derived segments are computed
        once for all of a model's layers."""
        return Packing(offsets, world)

    @functools.cached_property
    def local(self) -> Segments:
        """Documents along every rank's shard: each holds 1/P of each document."""
        return Segments(tuple(o // self.world for o in self.offsets))

    @functools.cached_property
    def halves(self) -> Segments:
        """Documents along each half of a zigzag shard in `zigzag_order`: 1/2P of each document."""
        return Segments(tuple(o // (2 * self.world) for o in self.offsets))

    def zigzag_order(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(order, inverse): shard[:, order] holds every document's first chunk, then every second chunk;
        x[:, inverse] undoes it."""
        return _zigzag_order(self.offsets, self.world, torch.device(device))


@functools.lru_cache(maxsize=64)
def _zigzag_order(offsets, world, device):
    local = [(a // world, b // world) for a, b in zip(offsets, offsets[1:])]
    first = [torch.arange(s, (s + e) // 2) for s, e in local]
    second = [torch.arange((s + e) // 2, e) for s, e in local]
    order = torch.cat(first + second)
    return to_device(order, device), to_device(torch.argsort(order), device)
