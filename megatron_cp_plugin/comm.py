"""Communication shared by the algorithms: the ring send/recv, byte counters, group checks.

Every call takes its process group explicitly (`group=None` is the default group); nothing here keeps
global process-group state.
"""
from __future__ import annotations

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
    """`group` or the default group; ValueError (raised before any collective) when this rank is not in it."""
    if not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised (call init_process_group first)")
    group = dist.group.WORLD if group is None else group
    if dist.get_rank(group) < 0:
        raise ValueError("group: this process is not a member of the given process group")
    return group


class Ring:
    """Send to the next rank of `group` and receive from the previous one, asynchronously.

    `send_recv(tensors)` posts one batch (so NCCL runs it on its own stream while the caller computes) and
    returns the receive buffers; `wait()` makes the current stream wait for the batch. Several rings may be
    in flight at once (ring attention's K,V and dK,dV); every rank must post them in the same order.
    """

    def __init__(self, group, phase: str, stats: CommStats | None = None):
        self.group, self.phase, self.stats = group, phase, stats
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world)
        self._works: list = []

    def send_recv(self, tensors) -> list[torch.Tensor]:
        send = [t.contiguous() for t in tensors]
        recv = [torch.empty_like(t) for t in send]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in recv]
        self._works = dist.batch_isend_irecv(ops)
        if self.stats is not None:
            self.stats.add(self.phase, sum(t.numel() * t.element_size() for t in send))
        return recv

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works = []
