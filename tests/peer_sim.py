"""Ranks of the NVLink peer kernels (kernels/peer_merge.py, peer_sum.py) simulated in one process, for their tests:
each "rank" a data buffer and a flag array on one device, their addresses in the pointer tables the kernels read
(what symmetric.PeerBuffers holds between real GPUs)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

PROGRAMS, WIDTH = 64, 8
"""symmetric.MAX_PROGRAMS, symmetric.MAX_WORLD: the flag array's shape [2, PROGRAMS, WIDTH]."""


def zero_flags(P: int, device) -> list[torch.Tensor]:
    return [torch.zeros(2, PROGRAMS, WIDTH, dtype=torch.int32, device=device) for _ in range(P)]


def bufs(data: list[torch.Tensor], flags: list[torch.Tensor], rank: int) -> SimpleNamespace:
    """Rank `rank`'s view, as symmetric.PeerBuffers: its own data and flags, every rank's addresses."""
    dev = data[0].device
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=dev)  # noqa: E731
    return SimpleNamespace(data=data[rank], flags=flags[rank], data_ptrs=ptrs(data), flag_ptrs=ptrs(flags),
                           rank=rank, world=len(data), fenced=False)
