"""--offload-layer-inputs: with full recompute, each layer's checkpointed input waits for the backward in pinned host
memory instead of on the GPU (issue 35: GPT-3 13B at 64k tokens on 2 x H200).

Full recompute (`--recompute-granularity full`, one layer a checkpoint) keeps one tensor per layer for the
backward: the layer's input, S / CP x h x 2 bytes (13B at 64k over CP = 2: 320 MiB a layer, 12.5 GiB for 40).
megatron-core's checkpoint (tensor_parallel.CheckpointFunction) keeps it with `ctx.save_for_backward`, so
torch's saved-tensor hooks see it: around the decoder's forward, `pack` copies every activation autograd saves (a
non-leaf tensor that requires grad: the checkpoints' inputs and the final norm's; not weights, rotary tables or
masks) to pinned host memory on a side stream and lets the GPU copy go; in the backward, `unpack` copies it back on
the compute stream just before that layer is recomputed. The hooks are off during the backward's recompute, so
what a recomputed layer saves stays on the GPU, for the moment it is needed.

Cost: two copies of each input over PCIe (an estimate, not timed apart: ~6 ms for 320 MiB at PCIe 5's ~55 GB/s a
direction, against a 13B 64k step of 14.3-15.5 s on 2 x H200 with it); the device-to-host copies overlap the next
layers' forward, the host-to-device ones are on the compute stream (no prefetch). Pinned
host memory: the kept bytes (12.5 GiB per rank for 13B at 64k), served by torch's caching host allocator. The
values come back bit for bit, so losses and gradients are those without the flag. On CPU ranks the host copy is a
plain copy (the same bookkeeping, for the tests).
"""
from __future__ import annotations

import torch


class _Offloaded:
    """A saved activation in host memory: the copy, the event its device-to-host copy recorded, its device."""

    __slots__ = ("host", "event", "device")

    def __init__(self, host, event, device):
        self.host, self.event, self.device = host, event, device


class LayerInputOffload:
    """Saved-tensor hooks that keep saved activations in host memory; `bytes_per_step` counts what one step moved
    (reset with `reset()`), `tensors` how many."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.reset()

    def reset(self) -> None:
        self.bytes_per_step = 0
        self.tensors = 0

    @staticmethod
    def offloads(t: torch.Tensor) -> bool:
        """Activations only: a weight (a leaf) stays where it is, and so does what needs no gradient (rotary
        tables, masks: shared by every layer, offloading them would copy one tensor once a layer)."""
        return t.requires_grad and not t.is_leaf and t.numel() > 0

    def pack(self, t: torch.Tensor):
        if not self.offloads(t):
            return t
        self.bytes_per_step += t.numel() * t.element_size()
        self.tensors += 1
        if self.stream is None:                             # CPU ranks: a plain copy stands for the host buffer
            return _Offloaded(t.detach().clone(), None, t.device)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(t.device))    # t is written
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)                    # t's memory is not reused before the copy is done
            event = torch.cuda.Event()
            event.record(self.stream)
        return _Offloaded(host, event, t.device)

    def unpack(self, p):
        if not isinstance(p, _Offloaded):
            return p
        if p.event is None:
            return p.host
        torch.cuda.current_stream(p.device).wait_event(p.event)
        return p.host.to(p.device, non_blocking=True)

    def hooks(self):
        """The context manager the decoder's forward runs in."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def install(decoder: torch.nn.Module, device: torch.device) -> LayerInputOffload:
    """Run `decoder` (megatron-core's TransformerBlock) forward under the offload hooks; returns them."""
    off = LayerInputOffload(device)
    forward = decoder.forward

    def offloaded_forward(*args, **kwargs):
        if not torch.is_grad_enabled():                     # evaluation: nothing is saved
            return forward(*args, **kwargs)
        with off.hooks():
            return forward(*args, **kwargs)

    decoder.forward = offloaded_forward
    return off
