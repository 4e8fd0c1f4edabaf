"""Symmetric memory among the ranks of one node: buffers that every rank's kernels can read and signal directly
over NVLink (torch.distributed._symmetric_memory). The one module that calls torch's symmetric memory; tree
decoding's exchange + merge kernel (kernels/peer_merge.py) is its user.

    bufs = peer_buffers(group, numel, device)   # collective, once, outside any CUDA graph capture
    bufs.data          this rank's fp32 [numel], which every peer can read
    bufs.data_ptrs     [P] int64 on the device: every rank's `data` address in this process's address space
    bufs.flag_ptrs     [P] int64: every rank's int32 flags [2, MAX_PROGRAMS, MAX_WORLD] (zero when idle)

Only unicast peer mappings are used, never NVLink multicast: TORCH_SYMM_MEM_DISABLE_MULTICAST defaults to 1 here
(a user's explicit setting stands), so torch's rendezvous does not create multicast objects either.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

MAX_WORLD = 8
"""Ranks of one NVLink node (the kernel's peer vector is this wide)."""
MAX_PROGRAMS = 64
"""Programs of one exchange kernel that signal separately (each has its own flag per phase and peer)."""


@dataclass
class PeerBuffers:
    """One rank's view of a symmetric allocation (see the module docstring)."""

    data: torch.Tensor
    """This rank's fp32 buffer, readable by every peer."""
    flags: torch.Tensor
    """This rank's int32 flags [2, MAX_PROGRAMS, MAX_WORLD]: flags[phase, program, sender] = 1 when `sender` has
    signalled it; the waiter resets it to 0."""
    data_ptrs: torch.Tensor
    """[world] int64 on the device: each rank's `data` as mapped into this process, in group-rank order."""
    flag_ptrs: torch.Tensor
    """[world] int64 on the device: each rank's `flags`."""
    rank: int
    world: int
    handles: tuple
    """torch's symmetric-memory handles, kept alive with the mappings."""
    fenced: bool = False
    """Set by `fence`: the kernels on these buffers skip their done round (one flag round a call, not two)."""


def fence(a: PeerBuffers, b: PeerBuffers) -> None:
    """Let the kernels on two buffers skip their done rounds, where the caller calls them strictly alternately
    (a, b, a, b, ...; the decode step's peer merge of each layer's attention and peer sum of its MLP), with the
    same shapes on every rank.

    Why that is safe: a rank writes its `a` partial for call k + 1 only after its `b` call k has ended, and every
    program of that call passed its ready round, which needs every peer's ready signal of `b` call k; a peer
    signals that only after its `a` call k has ended, that is after it read this rank's `a` partial of call k. So
    no partial is overwritten while a peer reads it, and the same holds for `b` with the roles swapped. A flag is
    never set twice before it is consumed, by the same argument. Stream order (and PDL's wait for the whole
    preceding grid, kernels/_launch.py) orders a call after the kernels before it. The done round cost 2.8 us a
    call in the 8B shape's graphed step on 2 x H200, 64 calls a step (docs/decode.md)."""
    if a is b or a.world != b.world or a.rank != b.rank:
        raise ValueError("fence: two different PeerBuffers of the same group and rank expected")
    a.fenced = b.fenced = True


def unsupported_reason(group, device: torch.device, *, collective: bool = False) -> str | None:
    """Why symmetric buffers cannot serve `group` on `device`, or None. Without `collective`, what this rank
    knows alone (no communication); with it, also that every rank is on one host and has its own GPU (one small
    all-gather: every rank of the group calls it, and all get the same answer)."""
    reason = None
    if device.type != "cuda":
        reason = f"tensors are on {device}, not a CUDA device"
    elif not dist.is_initialized() or dist.get_backend(group) != "nccl":
        reason = "the group is not an NCCL group (gloo ranks, or ranks sharing a GPU)"
    elif dist.get_world_size(group) > MAX_WORLD:
        reason = f"the group has {dist.get_world_size(group)} ranks, more than one node's {MAX_WORLD}"
    else:
        try:
            import torch.distributed._symmetric_memory  # noqa: F401
        except ImportError as e:
            reason = f"torch has no symmetric memory ({e})"
    if reason is not None or not collective:
        return reason
    # One host and one GPU a rank: peers map each other's memory over NVLink, and the exchange kernel spins on
    # its flags, which two ranks time-sharing one GPU could turn into a wait on each other. NVLink, not PCIe: the
    # kernel's flags are system-scope atomics on a peer's memory, which PCIe peer-to-peer often does not carry.
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (socket.gethostname(), str(props.uuid), index, props.name), group=group)
    if len({e[0] for e in every}) > 1:
        return "the group spans several hosts"
    if len({e[1] for e in every}) < len(every):
        return "ranks of the group share a GPU"
    if any("PCIe" in e[3] for e in every):
        return f"PCIe GPUs ({every[0][3]}): the kernel signals over NVLink"
    reach = all(torch.cuda.can_device_access_peer(index, e[2]) for e in every if e[2] != index)
    oks = [None] * len(every)
    dist.all_gather_object(oks, reach, group=group)
    if not all(oks):
        return "a rank's GPU cannot access a peer's memory (no peer-to-peer between them)"
    return None


def peer_buffers(group, numel: int, device: torch.device) -> PeerBuffers:
    """Allocate and map one symmetric fp32 buffer of `numel` and its flags on every rank of `group` (a collective:
    every rank calls it with the same numel; None: the default group). ValueError, the same on every rank, where it
    cannot."""
    group = dist.group.WORLD if group is None else group
    reason = unsupported_reason(group, device, collective=True)
    if reason is not None:
        raise ValueError(f"tree_decode variant 'peer' needs one NVLink node, one GPU a rank: {reason}")
    import torch.distributed._symmetric_memory as symm

    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    name = group.group_name
    enabled = getattr(symm, "is_symm_mem_enabled_for_group", None)
    if enabled is not None and not enabled(name):       # torch < 2.8 needs this; later ones ignore it
        symm.enable_symm_mem_for_group(name)
    data = symm.empty(numel, dtype=torch.float32, device=device)
    flags = symm.empty(2 * MAX_PROGRAMS * MAX_WORLD, dtype=torch.int32, device=device)
    flags.zero_()
    hd, hf = symm.rendezvous(data, group), symm.rendezvous(flags, group)
    # Every rank's flags are zero before any rank can signal into them.
    torch.cuda.synchronize(device)
    dist.barrier(group=group, device_ids=[device.index])
    return PeerBuffers(data, flags.view(2, MAX_PROGRAMS, MAX_WORLD), _mapped(hd, data), _mapped(hf, flags),
                       dist.get_rank(group), dist.get_world_size(group), (hd, hf))


def _mapped(handle, t: torch.Tensor) -> torch.Tensor:
    """Every rank's copy of t, as addresses in this process: a symmetric tensor lies at the same offset in each
    rank's allocation (torch may place several in one pooled block, so the block's base is not t's address)."""
    bases = list(handle.buffer_ptrs)
    offset = t.data_ptr() - bases[handle.rank]
    return torch.tensor([b + offset for b in bases], dtype=torch.int64, device=t.device)
