"""Communication shared by the algorithms: the ring send/recv, the collectives, byte counters, group checks, the
wire-precision rule (the grid the 2D algorithms run on is cp_grid.py's).

Every call takes its process group explicitly (`group=None` is the default group); nothing here keeps
global process-group state.
"""
from __future__ import annotations

import datetime

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """Bytes this rank sent, per phase. Pass one as `comm_stats=` to count an algorithm's traffic; it adds
    to the counters on every call (forward and backward), so one object can sum a whole step."""

    forward_bytes: int = 0
    """Bytes sent by this rank in forward passes."""
    backward_bytes: int = 0
    """Bytes sent by this rank in backward passes."""

    def add(self, phase: str, nbytes: int) -> None:
        setattr(self, f"{phase}_bytes", getattr(self, f"{phase}_bytes") + nbytes)


def resolve_group(group):
    """`group` (or a CPGrid's group) or the default group; ValueError (raised before any collective) when
    this rank is not in it."""
    from .cp_grid import CPGrid  # noqa: PLC0415 (cp_grid.py imports this module)
    if isinstance(group, CPGrid):
        group = group.group
    if not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised (call init_process_group first)")
    group = dist.group.WORLD if group is None else group
    if dist.get_rank(group) < 0:
        raise ValueError("group: this process is not a member of the given process group")
    return group


def group_size(group) -> int:
    """The members of `group` (through this module's torch.distributed, which the rank replay stands in for)."""
    return dist.get_world_size(group)


def group_rank(group) -> int:
    """This process's rank in `group` (as group_size)."""
    return dist.get_rank(group)


class Exchange:
    """Point-to-point messages among the members of `group`, asynchronously: `post(sends, recvs)` posts one batch
    (sends: (group rank, tensors) pairs, recvs: (group rank, contiguous destination tensors) pairs; NCCL runs it on
    its own stream while the caller computes), `wait()` makes the current stream wait for it. Every member posts
    its batches in the same order, and a batch's messages pair up with the peers' (ring attention's rounds: each
    rank sends its own K, V to the next g ranks and receives those of the previous g)."""

    def __init__(self, group, phase: str, stats: CommStats | None = None):
        self.group, self.phase, self.stats = group, phase, stats
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        # the members' global ranks, looked up once: torch's get_global_rank scans the group's rank map at every
        # call, and a round at P = 64 posts 128 messages (ring.post_round)
        self._global = dist.get_process_group_ranks(group)
        # gloo's send/recv take host tensors only ("writev: Bad address" on CUDA ones): with CUDA tensors on a
        # gloo group (ranks sharing a GPU, devices.py) each message is staged through host memory.
        self._staged = dist.get_backend(group) == "gloo"
        self._works: list = []
        self._landing: list = []

    def post(self, sends, recvs) -> None:
        sends = [(p, [t if t.is_contiguous() else t.contiguous() for t in ts]) for p, ts in sends]
        wire_sends, wire_recvs = sends, recvs
        if self._staged and any(t.is_cuda for _, ts in sends for t in ts):
            wire_sends = [(p, [t.cpu() for t in ts]) for p, ts in sends]        # synchronous: final when sent
            wire_recvs = [(p, [torch.empty(t.shape, dtype=t.dtype) for t in ts]) for p, ts in recvs]
            self._landing += [(h, d) for (_, hs), (_, ds) in zip(wire_recvs, recvs) for h, d in zip(hs, ds)]
        glob = self._global
        ops = [dist.P2POp(dist.isend, t, glob[p], self.group) for p, ts in wire_sends for t in ts]
        ops += [dist.P2POp(dist.irecv, t, glob[p], self.group) for p, ts in wire_recvs for t in ts]
        if ops:
            self._works += dist.batch_isend_irecv(ops)
        if self.stats is not None:
            self.stats.add(self.phase, sum(t.numel() * t.element_size() for p, ts in sends for t in ts
                                           if p != self.rank))

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works = []
        for host, dev in self._landing:                          # staged: the received bytes onto the device
            dev.copy_(host)
        self._landing = []


class Ring(Exchange):
    """Send to the next rank of `group` and receive from the previous one, asynchronously.

    `send_recv(tensors)` posts one batch (so NCCL runs it on its own stream while the caller computes) and
    returns the receive buffers; `wait()` makes the current stream wait for the batch. Several rings may be
    in flight at once (ring attention's K,V and dK,dV); every rank must post them in the same order.
    """

    def send_recv(self, tensors) -> list[torch.Tensor]:
        send = [t.contiguous() for t in tensors]
        recv = [torch.empty_like(t) for t in send]
        self.post([((self.rank + 1) % self.world, send)], [((self.rank - 1) % self.world, recv)])
        return recv


# ----------------------------------------------------------------------------------------------- wire precision
def wire_bytes(hops: int, elem: int, acc: int) -> int:
    """Element size of a partial sum on the wire (the wire-precision policy, docs/design.md): the input
    dtype's when it is summed once, at its owner (one hop, or an all-to-all); the accumulator's when it is
    summed again on its way (a ring reduce-scatter of more than one hop), so no sum is rounded twice."""
    return elem if hops <= 1 else acc


def wire_dtype(hops: int, dtype: torch.dtype, acc: torch.dtype) -> torch.dtype:
    """`wire_bytes` as a dtype: what a partial sum made of the input dtype's kernel results travels in round a ring of
    `hops` hops (Attention2D-O's column ring; ring's dK, dV and burst's dQ accumulators at P = 2, one hop)."""
    return dtype if hops <= 1 else acc


# ----------------------------------------------------------------------------------------------- collectives
# Byte counts are what one rank sends: an all-gather (as a ring, what NCCL uses at these sizes) or an all-to-all
# among g ranks sends (g - 1) chunks; a permutation step one chunk, or none for a rank that keeps its own.
# torch 2.13 renamed all_gather_into_tensor (all_gather_single); 2.11 (the GPU image) has only the old name.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


_HELD_WORK: dict = {}


def run_collective(op, *args, group=None, **kw):
    """`op(*args, group=group, **kw)` (a torch.distributed collective), waited for. On CPU (gloo) the finished
    work stays referenced here until the group's next collective. Gloo runs a collective on a worker thread that
    drops its own reference to the work just after the caller resumes, and with it maybe the last one to the
    tensors, a release that takes the GIL; a script that ended right after its last collective raced that
    release against interpreter finalization, where a thread that asks for the GIL is ended by pthread_exit,
    whose unwind through a noexcept destructor calls std::terminate: SIGABRT at exit, "terminate called without
    an active exception" (issue 29; tests/exit_check.py). Held here, the work is freed by the thread that
    replaces or clears the entry, which holds the GIL."""
    start_collective(op, *args, group=group, **kw).wait()


class Posted:
    """A collective posted and not yet waited for (`start_collective`): `wait()` once before reading what it writes.
    Holds the work and its tensors until then; after it, as run_collective does (its CPU exit safety)."""

    def __init__(self, work, group, cpu: bool, tensors=()):
        self.work, self.group, self.cpu, self.tensors = work, group, cpu, tensors

    def wait(self) -> None:
        if self.work is None:
            return
        self.work.wait()
        if self.cpu:
            _HELD_WORK[self.group] = self.work
        self.work = self.tensors = None


def start_collective(op, *args, group=None, **kw) -> Posted:
    """`op(*args, group=group, async_op=True, **kw)`, not waited for: the caller computes while it runs (on NCCL its
    own stream; `wait()` makes the current stream wait for it)."""
    work = op(*args, group=group, async_op=True, **kw)
    first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
    return Posted(work, group, first.device.type == "cpu", args)


def _count(stats, phase, nbytes):
    if stats is not None:
        stats.add(phase, int(nbytes))


def all_gather(group, x: torch.Tensor, stats=None, phase="forward") -> torch.Tensor:
    """[g, *x.shape]: every member's x, in group-rank order (x itself when group is None)."""
    out, posted = all_gather_start(group, x, stats, phase)
    posted.wait()
    return out


def all_gather_start(group, x: torch.Tensor, stats=None, phase="forward") -> tuple[torch.Tensor, Posted]:
    """all_gather posted: (out, posted); read out (its own row included, which the collective writes) only after
    posted.wait(). The caller computes with its own x while the others arrive."""
    if group is None:
        return x.unsqueeze(0), Posted(None, None, False)
    g = dist.get_world_size(group)
    out = torch.empty((g,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    flat = x.contiguous().view(-1)
    posted = start_collective(_ALL_GATHER, out.view(-1), flat, group=group)        # 1-D: gloo wants that
    _count(stats, phase, (g - 1) * x.numel() * x.element_size())
    return out, posted


def all_to_all(group, parts, stats=None, phase="forward", recv=None) -> list:
    """One all-to-all of several tensors of any dtypes (fp32 lse beside bf16 outputs): chunk c of each part goes to
    member c; returns each part with chunk c from member c (`parts` itself when group is None).

    Equal chunks: each part a tensor [g, ...] (any strides: a strided part is copied into the send buffer once,
    a lone contiguous part is sent as it is), returned as one, a view of the receive buffer (strided where several
    parts share it; a copy only where a part's bytes are not aligned for its dtype). Unequal chunks (ulysses' K, V
    heads where members read different numbers of them): a part may instead be a list of g tensors of one dtype
    (chunk c for member c), and `recv[i]` the g shapes of the chunks part i receives (None: the shape it sends, for
    a tensor part); such a part comes back as a list. Unequal chunks travel as they are, with all_to_all_single's
    split sizes: padding them to the largest would send bytes for nothing, while split sizes cost nothing (torch
    runs the equal-split all-to-all on NCCL as the same one send and one receive per peer)."""
    return all_to_all_start(group, parts, stats, phase, recv).wait()


class PostedAllToAll:
    """An all_to_all posted and not yet waited for (`all_to_all_start`): `wait()` returns what all_to_all returns."""

    def __init__(self, posted: Posted | None, unpack):
        self.posted, self.unpack = posted, unpack

    def wait(self) -> list:
        if self.posted is not None:
            self.posted.wait()
        unpack, self.unpack = self.unpack, None                     # once: the receive buffer goes with it
        return unpack()

    def then(self, fn) -> PostedAllToAll:
        """The same collective, whose wait() returns fn(what this one's wait() returns): the caller's own unpacking,
        after which the receive buffer goes as well."""
        return PostedAllToAll(None, lambda: fn(self.wait()))


def send_buffer(g: int, specs, device) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """(packed, views): one all_to_all send buffer of g members' bytes for parts of `specs` [(dtype, shape), ...]
    (shape [g, ...]: member c's chunk at [c]), and a typed view of it per part, for a caller that writes each part
    in place (e.g. rows taken in another order, without an intermediate tensor) and posts
    `all_to_all_start(group, views, packed=packed)`. views is None where a part's bytes would not be aligned for its
    dtype (mixed element sizes): then the caller builds the parts as tensors."""
    sizes = [torch.Size(shape[1:]).numel() * dt.itemsize for dt, shape in specs]
    packed = torch.empty((g, sum(sizes)), dtype=torch.uint8, device=device)
    views, at = [], 0
    for (dt, shape), n in zip(specs, sizes):
        v = _typed(packed, at, n, dt, shape)
        if v is None:
            return packed, None
        views.append(v)
        at += n
    return packed, views


def all_to_all_start(group, parts, stats=None, phase="forward", recv=None, packed=None) -> PostedAllToAll:
    """all_to_all posted: the send buffer is packed and the collective started (on NCCL its own stream), and
    `wait()` returns the parts as all_to_all does. The caller computes while it travels (ulysses' head chunks).
    `packed`: the parts are the views of this buffer that `send_buffer` gave, already written: sent as is."""
    if recv is None and all(isinstance(t, torch.Tensor) for t in parts):
        if group is None:
            return PostedAllToAll(None, lambda: [t.contiguous() for t in parts])
        g = dist.get_world_size(group)
        sizes = [t[0].numel() * t.element_size() for t in parts]
        if packed is not None:
            flat = packed
        elif len(parts) == 1 and parts[0].is_contiguous():
            flat = parts[0].view(g, -1).view(torch.uint8)                        # no copy: the bytes as they are
        elif all(t.is_contiguous() for t in parts):
            flat = torch.cat([t.view(g, -1).view(torch.uint8) for t in parts], dim=1)   # bytes side by side
        else:                                       # strided parts (a permuted view): each copied in once, in place
            flat = torch.empty((g, sum(sizes)), dtype=torch.uint8, device=parts[0].device)
            at = 0
            for t, n in zip(parts, sizes):
                dst = _typed(flat, at, n, t.dtype, t.shape)
                if dst is None:
                    flat[:, at:at + n] = t.contiguous().view(g, -1).view(torch.uint8)
                else:
                    dst.copy_(t)
                at += n
        out = torch.empty_like(flat)
        posted = start_collective(dist.all_to_all_single, out, flat, group=group)
        _count(stats, phase, (g - 1) * flat[0].numel())
        shapes = [(t.dtype, t.shape) for t in parts]                 # not the parts: their memory may go now

        def unpack():
            res, at = [], 0
            for (dt, shape), n in zip(shapes, sizes):
                # Each part a view of the receive buffer where its bytes are aligned for its dtype (no copy).
                x = _typed(out, at, n, dt, shape)
                res.append(x if x is not None else out[:, at:at + n].contiguous().view(dt).view(shape))
                at += n
            return res
        return PostedAllToAll(posted, unpack)
    recv = recv or [None] * len(parts)
    if group is None:
        return PostedAllToAll(None, lambda: [p if r is None else list(p) for p, r in zip(parts, recv)])
    g, me = dist.get_world_size(group), dist.get_rank(group)
    dtypes = [p[0].dtype for p in parts]
    shapes = [[tuple(p[0].shape)] * g if r is None else [tuple(x) for x in r] for p, r in zip(parts, recv)]
    if packed is not None:                          # member c's bytes, part by part, are row c: sent as they are
        send, split_in = packed.view(-1), [packed.shape[1]] * g
    else:
        raw = lambda t: t.contiguous().view(-1).view(torch.uint8)  # noqa: E731
        chunks = [torch.cat([raw(p[c]) for p in parts]) for c in range(g)]     # member c's bytes, part by part
        send, split_in = torch.cat(chunks), [x.numel() for x in chunks]
    nbytes = [[torch.Size(s[c]).numel() * dt.itemsize for c in range(g)] for s, dt in zip(shapes, dtypes)]
    split_out = [sum(n[c] for n in nbytes) for c in range(g)]
    out = torch.empty(sum(split_out), dtype=torch.uint8, device=send.device)
    posted = start_collective(dist.all_to_all_single, out, send, split_out, split_in, group=group)
    _count(stats, phase, sum(split_in) - split_in[me])

    n_parts = len(parts)

    def unpack():
        got = [[] for _ in range(n_parts)]
        at = 0
        for c in range(g):
            for i, (dt, s) in enumerate(zip(dtypes, shapes)):
                x = out[at:at + nbytes[i][c]]
                got[i].append((x if at % dt.itemsize == 0 else x.clone()).view(dt).view(s[c]))  # aligned
                at += nbytes[i][c]
        return [torch.stack(x) if r is None else x for x, r in zip(got, recv)]
    return PostedAllToAll(posted, unpack)


def _typed(buf: torch.Tensor, at: int, n: int, dtype: torch.dtype, shape):
    """Columns at .. at + n of the byte buffer buf [g, row] as a tensor of that dtype and shape (a strided view), or
    None where the bytes are not aligned for the dtype."""
    e = dtype.itemsize
    if at % e or buf.shape[1] % e or buf.storage_offset() % e:
        return None
    return buf[:, at:at + n].view(dtype).view(shape)


def reduce_at_owner(group, x: torch.Tensor, me: int, wire: torch.dtype, stats=None, phase="backward"):
    """Sum over members of x [g, ...] (x's dtype: the accumulator's), chunk `me` (this rank's index in the
    group) kept: each member's partial travels once, in `wire`, and is summed here in x's dtype; the own
    partial is never rounded. What a reduce-scatter computes, in half the bytes for bf16 partials. x may be a
    strided view (all_to_all packs it)."""
    if group is None:
        return x[0]
    # A strided x is cast (or copied) straight into a contiguous send buffer: one pass.
    posted = all_to_all_start(group, [x.to(wire, memory_format=torch.contiguous_format)], stats, phase)
    if wire == x.dtype:                          # the own chunk came back as sent: x[me], unrounded
        return posted.wait()[0].sum(0)
    return PostedReduce(posted, me, x.dtype).wait(x[me])


class PostedReduce:
    """reduce_at_owner posted before the own partial is final (`reduce_at_owner_start`): wait(own) sums the others'
    partials, as they arrive, with `own`, this rank's final partial (x[me])."""

    def __init__(self, posted: PostedAllToAll, me: int, dtype: torch.dtype):
        self.posted, self.me, self.dtype = posted, me, dtype

    def wait(self, own: torch.Tensor) -> torch.Tensor:
        """The others' partials summed in x's dtype as they are read (no upcast copy), then `own`, unrounded (the
        chunk that travelled to itself is dropped: rounded to the wire, and unfinished where posted early)."""
        (got,) = self.posted.wait()
        got[self.me].zero_()
        return torch.sum(got, 0, dtype=self.dtype).add_(own)


def reduce_at_owner_start(group, x: torch.Tensor, me: int, wire: torch.dtype, stats=None,
                          phase="backward") -> PostedReduce:
    """reduce_at_owner, posted while x[me] is still being summed into: the other chunks (final) travel now, in
    `wire`, and the rank computes its own partial meanwhile; `.wait(x[me])` returns the sum. The same bytes and
    the same sum as reduce_at_owner's in the 16-bit case (the own partial added last, unrounded); x is always
    copied into the send buffer, so later writes to x[me] never race the transfer."""
    send = torch.empty(x.shape, dtype=wire, device=x.device)
    send.copy_(x)
    return PostedReduce(all_to_all_start(group, [send], stats, phase), me, x.dtype)


def permute(group, x: torch.Tensor, send_to: int, recv_from: int, stats=None, phase="forward") -> torch.Tensor:
    """One step of a permutation of the members' x: send x to group rank `send_to`, return the x of
    `recv_from`. An all-to-all with one nonzero split per rank, so every member takes part (NCCL wants that
    from the first operation on a group); a rank that keeps its own x sends nothing."""
    g, me = dist.get_world_size(group), dist.get_rank(group)
    x = x.contiguous()
    out = torch.empty_like(x)
    split_in = [x.shape[0] if r == send_to else 0 for r in range(g)]
    split_out = [x.shape[0] if r == recv_from else 0 for r in range(g)]
    run_collective(dist.all_to_all_single, out, x, split_out, split_in, group=group)
    if send_to != me:
        _count(stats, phase, x.numel() * x.element_size())
    return out


def serve_store(timeout_s: float = 300.0) -> dist.TCPStore:
    """A rendezvous store this process serves on a port the OS picks (`.port`), bound for as long as the object
    lives: the launcher's spawned ranks, the demo's and the tests' pools join it with `init_group(port=...)`, and
    a lone rank uses one of its own. Picking a free port, closing it and letting a rank bind it later raced with
    every other process on the machine (EADDRINUSE in test_checkpoint with 20 pytest workers on 2 x H200; two
    jobs of a user on one node can do the same); a port that is never released cannot be taken."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def init_group(backend: str, rank: int, world: int, port: int | None = None, timeout_s: float = 300.0,
               **kwargs) -> None:
    """init_process_group over the store served on 127.0.0.1:`port` (serve_store in the launching process), or,
    with port None and one rank, over a store of this process's own; kwargs go to init_process_group."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if port is None:
        if world != 1:
            raise ValueError(f"world={world}: ranks of a local job join their launcher's store (port=...)")
        store = serve_store(timeout_s)
    else:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs)
