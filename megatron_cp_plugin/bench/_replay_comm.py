"""torch.distributed as comm.py sees it, for one rank replayed in one process (bench/rank_replay.py).

`comm.py` is the only module of the algorithms that calls torch.distributed (`comm.dist`, `comm._ALL_GATHER`; cp_grid.py
builds its process groups through `comm.dist` too).
`patched(d)` swaps both for `d` while an algorithm runs, so everything above the wire runs unchanged: the
algorithm's kernels, merges, casts and accumulations, and comm.py's own packing (`Ring`'s contiguous copies and
receive buffers, `all_to_all`'s byte packing, `reduce_at_owner`'s casts and sum, `CPGrid`'s bookkeeping).

`ReplayDist(world, rank)` plays every other rank: each receive is filled by an on-device copy of the bytes it
would receive (a posted batch of them by one multi-tensor copy a dtype, as NCCL runs a batch as one grouped launch).
On CUDA the copies of what the algorithm posts (a p2p batch, an asynchronous collective) run on a wire stream of
their own, as NCCL's kernels do, and the algorithm's `wait()` makes its stream wait for them: the replay charges
the rank the overlap the algorithm arranges (with a link infinitely fast: only the landing's memory traffic);
`wire="inline"` puts them on the rank's stream, serial, as the replay did before the eleventh session.
Its first run `prepare`s them: a receive gets a copy of what this rank sends in the same call (right shapes,
dtypes and realistic values: the rank's own data; the first of each shape and dtype is kept and reused), the
source of later runs. Given a `source` (e.g. what `Recorder` captured from a real run), it replays exactly
those bytes, so its outputs equal the distributed run's (tests/test_rank_replay.py). `Recorder` wraps the real
torch.distributed and keeps a copy of every receive, in the same order.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as _dist

from .. import comm


@contextlib.contextmanager
def patched(d):
    """comm.py's torch.distributed replaced by `d` (a ReplayDist or Recorder) inside the block."""
    for name in ("dist", "_ALL_GATHER"):        # a renamed hook would otherwise make the replay call real dist
        if not hasattr(comm, name):
            raise AssertionError(f"bench replay: comm.{name} is gone; update bench/_replay_comm.py")
    saved = comm.dist, comm._ALL_GATHER
    comm.dist, comm._ALL_GATHER = d, d.all_gather
    try:
        yield d
    finally:
        comm.dist, comm._ALL_GATHER = saved


@dataclass(frozen=True, eq=False)
class FakeGroup:
    """A process group of global ranks `ranks`, seen from global rank `me`."""

    ranks: tuple
    me: int


@dataclass(frozen=True)
class _P2POp:
    op: object
    tensor: torch.Tensor
    peer: int
    group: object = None
    tag: int = 0


class _Done:
    def wait(self):
        return True


class _Landed:
    """A posted receive batch replayed on the wire stream: `wait()` makes the current stream wait for its copies,
    as NCCL's work.wait() makes it wait for NCCL's stream."""

    def __init__(self, event):
        self.event = event

    def wait(self):
        torch.cuda.current_stream().wait_event(self.event)
        return True


def isend(*_a, **_k):     # P2POp markers only: comm.py posts every transfer through batch_isend_irecv
    raise AssertionError("replay: isend is only posted through batch_isend_irecv")


def irecv(*_a, **_k):
    raise AssertionError("replay: irecv is only posted through batch_isend_irecv")


class ReplayDist:
    """torch.distributed for global rank `rank` of `world`, without a process group (see the module docstring).

    copies / copied_bytes count the replayed receives since the last `rewind`."""

    P2POp, isend, irecv = _P2POp, staticmethod(isend), staticmethod(irecv)

    WIRES = ("stream", "inline")

    def __init__(self, world: int, rank: int, source: list | None = None, backend: str = "nccl", wire: str = "stream"):
        if wire not in self.WIRES:
            raise ValueError(f"wire must be one of {self.WIRES}, got {wire!r}")
        self.world, self.rank, self.backend, self.wire = world, rank, backend, wire
        self._stream = None
        self.delay_cycles = 0            # tests: a sleep on the wire stream before each batch (a missing wait shows)
        self.WORLD = FakeGroup(tuple(range(world)), rank)
        self.preparing = source is None
        self.source = [] if source is None else source
        self._pool = {}
        self.rewind()

    def rewind(self):
        """Start a new call (fwd, or fwd + bwd): the next receive is the source's first."""
        self.cursor = self.copies = self.copied_bytes = 0
        if self.preparing and self.source:
            self.preparing = False

    def _fill_many(self, outs: list, echoes: list, posted: bool = True):
        """One batch of receives; returns its work. Replayed, they land in one multi-tensor copy
        (`torch._foreach_copy_`) per dtype (a list of mixed dtypes takes foreach's slow path, one copy a tensor: burst's
        (Q, dO, D, lse) batches were 504 memcpys at 128k P = 64, eleventh session's H100 profile): a batch of p2p
        messages is one grouped NCCL launch in a real run, so one copy per tensor (4 per source a ring round, 567 at
        128k P = 64 in the ninth session's H100 profile, 5.3 ms of 31) put launches on the rank's host time that the
        wire does not. `posted` (p2p batches, asynchronous collectives): on the wire stream (module docstring).
        Preparing (the first, untimed call) goes one by one, inline."""
        if self.preparing:
            for out, echo in zip(outs, echoes, strict=True):
                self._fill(out, echo)
            return _Done()
        srcs = [self._next_source(out) for out in outs]
        stream = self._wire_stream(outs[0]) if posted else None
        if stream is None:
            self._copy_many(outs, srcs)
            return _Done()
        stream.wait_stream(torch.cuda.current_stream(outs[0].device))   # buffers free, as NCCL waits for the poster
        with torch.cuda.stream(stream):
            if self.delay_cycles:
                torch.cuda._sleep(self.delay_cycles)
            self._copy_many(outs, srcs)
            event = torch.cuda.Event()
            event.record(stream)
        return _Landed(event)

    @staticmethod
    def _copy_many(outs, srcs):
        by_dtype: dict = {}
        for out, src in zip(outs, srcs, strict=True):
            by_dtype.setdefault(out.dtype, ([], []))
            by_dtype[out.dtype][0].append(out)
            by_dtype[out.dtype][1].append(src)
        for o, s in by_dtype.values():
            if len(o) == 1:
                o[0].copy_(s[0])
            else:
                torch._foreach_copy_(o, s)

    def _wire_stream(self, out: torch.Tensor):
        """The wire stream of `out`'s device (made once), or None: inline wire, or not CUDA."""
        if self.wire != "stream" or not out.is_cuda:
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(out.device)
        return self._stream

    def _next_source(self, out: torch.Tensor) -> torch.Tensor:
        """The prepared bytes of the next receive (checked against `out`), counted."""
        if self.cursor >= len(self.source):
            raise AssertionError(f"replay: receive {self.cursor} has no prepared source ({len(self.source)} "
                                 "prepared): the algorithm's communication differs from the prepared run")
        src = self.source[self.cursor]
        if src.shape != out.shape or src.dtype != out.dtype:
            raise AssertionError(f"replay: receive {self.cursor} is {out.dtype} {tuple(out.shape)}, prepared "
                                 f"{src.dtype} {tuple(src.shape)}")
        self.cursor += 1
        self.copies += 1
        self.copied_bytes += out.numel() * out.element_size()
        return src

    def _fill(self, out: torch.Tensor, echo: torch.Tensor):
        if self.preparing:
            # One prepared tensor per shape and dtype: the copies and their bytes are what matter, and a long
            # ring's receives would not all fit (ring, P = 16, 1M tokens: 60 GB of them).
            key = (tuple(out.shape), out.dtype)
            if key not in self._pool:
                self._pool[key] = echo.clone(memory_format=torch.contiguous_format)
            out.copy_(self._pool[key])
            self.source.append(self._pool[key])
            self.cursor += 1
            self.copies += 1
            self.copied_bytes += out.numel() * out.element_size()
        else:
            out.copy_(self._next_source(out))

    # -- groups
    def is_initialized(self):
        return True

    def get_rank(self, group=None):
        g = group or self.WORLD
        return g.ranks.index(g.me)

    def get_world_size(self, group=None):
        return len((group or self.WORLD).ranks)

    def get_global_rank(self, group, p):
        return group.ranks[p]

    def get_process_group_ranks(self, group):
        return list((group or self.WORLD).ranks)

    def get_backend(self, group=None):
        return self.backend

    def new_group(self, ranks, **_kw):
        return FakeGroup(tuple(ranks), self.rank)

    # -- transfers (what comm.py calls)
    def batch_isend_irecv(self, ops):
        sends = [o.tensor for o in ops if o.op is isend]
        recvs = [o.tensor for o in ops if o.op is irecv]
        if len(sends) != len(recvs):                     # comm.Exchange: each receive shaped as its send
            raise AssertionError(f"replay: a batch of {len(sends)} sends and {len(recvs)} receives")
        return [self._fill_many(recvs, sends)]

    def all_to_all_single(self, out, inp, out_split_sizes=None, in_split_sizes=None, group=None, async_op=False):
        work = self._fill_many([out], [inp.view(out.shape)], posted=async_op)
        return work if async_op else None

    def all_gather(self, out, inp, group=None, async_op=False):
        g = out.numel() // inp.numel()
        # The echo (every member's x this rank's own) is a copy, read only while preparing: built only then, so that
        # a timed (or counted) call does what the real one does, one receive, and not a copy more.
        echo = inp.reshape(1, -1).expand(g, -1).reshape(out.shape) if self.preparing else None
        work = self._fill_many([out], [echo], posted=async_op)
        return work if async_op else None

    def __getattr__(self, name):                     # constants and types (ReduceOp, ...) are the real ones
        return getattr(_dist, name)


class _RecordedWork:
    def __init__(self, works, recvs, slot, store):
        self.works, self.recvs, self.slot, self.store = works, recvs, slot, store

    def wait(self):
        for w in self.works:
            w.wait()
        if self.recvs is not None:                   # the receives are complete now, and not yet touched
            self.store[self.slot:self.slot + len(self.recvs)] = [r.clone() for r in self.recvs]
            self.recvs = None
        return True


class Recorder:
    """The real torch.distributed, keeping a copy of every receive in `source`, in the order ReplayDist
    consumes them (a ring batch's receives at its post, filled in when it is waited for)."""

    def __init__(self):
        self.source = []

    def batch_isend_irecv(self, ops):
        recvs = [o.tensor for o in ops if o.op is _dist.irecv]
        slot = len(self.source)
        self.source.extend([None] * len(recvs))
        return [_RecordedWork(_dist.batch_isend_irecv(ops), recvs, slot, self.source)]

    def all_to_all_single(self, out, inp, *a, **k):
        r = _dist.all_to_all_single(out, inp, *a, **k)
        if r is not None:                 # asynchronous (comm.run_collective): complete before the copy
            r.wait()
        self.source.append(out.clone())
        return r

    def all_gather(self, out, inp, *a, **k):
        r = _ALL_GATHER_REAL(out, inp, *a, **k)
        if r is not None:
            r.wait()
        self.source.append(out.clone())
        return r

    def __getattr__(self, name):
        return getattr(_dist, name)


_ALL_GATHER_REAL = comm._ALL_GATHER
