"""Packed segments (documents) along the rows of a local attention block: the bookkeeping `local_attn` needs
to run varlen kernels, kept on the host so that no kernel launch waits for the device.

A `Segments` is a cu_seqlens: 0 = offsets[0] <= ... <= offsets[-1] = rows, as host ints. Query segment i
attends to key segment i only; a mask ("causal", "causal_strict") applies inside each pair, which then needs
equal lengths (the diagonal is the same whichever corner it is aligned to).
"""
from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segments:
    """Cumulative segment boundaries of a block's rows (cu_seqlens as host ints)."""

    offsets: tuple[int, ...]
    """0, then the end of every segment; offsets[-1] is the number of rows."""

    @staticmethod
    def of(x) -> "Segments":
        """A Segments from a Segments, a 1-D integer tensor (one device sync if on a GPU) or a sequence of ints."""
        if isinstance(x, Segments):
            return x
        if isinstance(x, torch.Tensor):
            if x.dim() != 1 or x.is_floating_point():
                raise ValueError(f"cu_seqlens must be a 1-D integer tensor, got {x.dtype} {tuple(x.shape)}")
            x = x.tolist()
        offs = tuple(int(v) for v in x)
        if len(offs) < 2 or offs[0] != 0 or any(b < a for a, b in zip(offs, offs[1:])):
            raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {list(offs[:8])}...")
        return Segments(offs)

    @property
    def rows(self) -> int:
        return self.offsets[-1]

    @property
    def count(self) -> int:
        return len(self.offsets) - 1

    @property
    def max_len(self) -> int:
        return max(b - a for a, b in zip(self.offsets, self.offsets[1:]))

    def scaled(self, div: int) -> "Segments":
        """Every boundary divided by `div` (a rank's share of documents laid out on their own)."""
        return Segments(tuple(o // div for o in self.offsets))

    def segment_of(self, row: int) -> int:
        """Index of the (non-empty) segment that holds `row`."""
        return bisect.bisect_right(self.offsets, row) - 1

    def cu(self, device) -> torch.Tensor:
        """int32 [count + 1] on `device`, made once per device."""
        return _cu(self.offsets, torch.device(device))

    def ids(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(segment index, position inside the segment) of every row, LongTensors [rows] on `device`."""
        return _ids(self.offsets, torch.device(device))


def to_device(x: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device` without making the host wait for the GPU's queue (pinned, asynchronous copy;
    torch keeps the pinned buffer alive until the copy is done)."""
    device = torch.device(device)
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


@functools.lru_cache(maxsize=256)
def index_tensor(values: tuple[int, ...], device) -> torch.Tensor:
    """LongTensor of `values` on `device`, made once per (values, device)."""
    return to_device(torch.tensor(values, dtype=torch.long), device)


@functools.lru_cache(maxsize=256)
def _cu(offsets, device):
    return to_device(torch.tensor(offsets, dtype=torch.int32), device)


@functools.lru_cache(maxsize=256)
def _ids(offsets, device):
    offs = torch.tensor(offsets, dtype=torch.long)
    lens = offs[1:] - offs[:-1]
    seg = torch.repeat_interleave(torch.arange(len(lens)), lens)
    return to_device(seg, device), to_device(torch.arange(offsets[-1]) - offs[:-1][seg], device)


@functools.lru_cache(maxsize=256)
def nonempty(sq: Segments, sk: Segments) -> tuple[Segments, Segments]:
    """The pairs left after dropping those with no query and no key row (kernels need no empty launches)."""
    keep = [i for i in range(sq.count) if sq.offsets[i + 1] > sq.offsets[i] or sk.offsets[i + 1] > sk.offsets[i]]
    if len(keep) == sq.count:
        return sq, sk
    return (Segments((0,) + tuple(sq.offsets[i + 1] for i in keep)),
            Segments((0,) + tuple(sk.offsets[i + 1] for i in keep)))


@functools.lru_cache(maxsize=256)
def strict_view(seg: Segments) -> tuple[Segments, tuple[int, ...]]:
    """A "causal_strict" mask (key j visible to query i iff j < i, inside each segment) as a plain causal one
    over the views q[1:], k[:-1] of the block, whose row x is query row x + 1 and key row x.

    A segment [s, e) becomes view rows [s, e - 1): query s + 1 + t sees keys s .. s + t, i.e. causal. The view
    row e - 1 between two segments pairs the next segment's first query with this one's last key: a 1 x 1
    dummy segment whose result the caller discards (forward: o = 0, lse = -inf; backward: lse = +inf, so
    that P = 0 and it adds nothing). Returns (view segments, dummy view rows); query row 0 is not in the view
    and every segment's first query sees nothing, as in the unpacked strict mask."""
    bounds, dead = {0, seg.rows - 1}, []
    for s, e in zip(seg.offsets, seg.offsets[1:]):
        if e == s:
            continue
        bounds.update((s, e - 1))
        if e < seg.rows:                         # not the last segment: its last row x = e - 1 is a dummy
            bounds.add(e)
            dead.append(e - 1)
    offs = tuple(sorted(b for b in bounds if 0 <= b <= seg.rows - 1))
    return Segments(offs), tuple(dead)
