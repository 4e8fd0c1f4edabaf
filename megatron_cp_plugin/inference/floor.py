"""The memory-bandwidth floor of a decode step, and the GPU figures it needs.

At batch sizes of a few sequences a decode step is memory-bound: every rank reads all of its weights (under
context parallelism every rank holds them all) and its own KV shard once per step, so no step can be faster
than (weight bytes + this rank's KV shard bytes) / the GPU's memory bandwidth. The bandwidth is a measured
device-to-device copy (read + write counted): H200 ~4.3 TB/s, H100 ~3.0 TB/s; other GPUs are measured.
"""
from __future__ import annotations

import torch

# Device-to-device copy bandwidth (bytes/s), by a substring of torch.cuda.get_device_name().
GPU_BANDWIDTH = {"H200": 4.3e12, "H100": 3.0e12}


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Measured bytes/s of a device-to-device copy of `nbytes` (read + write counted), median of 10."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return 2 * nbytes / sorted(times)[len(times) // 2]


def memory_bandwidth(device: torch.device, override: float | None = None) -> float | None:
    """The floor's bandwidth in bytes/s: `override`, else the GPU's figure, else measured; None on a CPU."""
    if override is not None:
        if not override > 0:
            raise ValueError(f"memory bandwidth must be positive, got {override}")
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, bw in GPU_BANDWIDTH.items():
        if key in name:
            return bw
    return copy_bandwidth(device)


def hardware_of(device: torch.device):
    """The cost model's hardware preset for this device (H100: h100-ib; otherwise h200-nvlink)."""
    from ..cost import HARDWARE

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return HARDWARE["h100-ib" if "H100" in name else "h200-nvlink"]


def weight_bytes(model) -> int:
    """Bytes of this rank's parameters (each shared tensor once): what a decode step reads of the weights."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def decode_floor(weights: int, kv_shard: int, bandwidth: float) -> float:
    """Seconds per decode step at the bandwidth floor: (weight bytes + this rank's KV shard bytes) / bandwidth."""
    return (weights + kv_shard) / bandwidth


def floor_line(weights: int, kv_shard: int, bandwidth: float | None, step_s: float | None = None) -> str:
    """One report line: the floor's bytes and time, and a measured step's ratio to it."""
    if bandwidth is None:
        return f"bandwidth floor: n/a on a CPU (weights {weights / 1e9:.2f} GB + KV shard {kv_shard / 1e9:.2f} GB)"
    fl = decode_floor(weights, kv_shard, bandwidth)
    line = (f"bandwidth floor {fl * 1e3:.2f} ms per token = (weights {weights / 1e9:.2f} GB + this rank's KV "
            f"shard {kv_shard / 1e9:.2f} GB) / {bandwidth / 1e12:.2f} TB/s")
    return line + (f"; measured {step_s * 1e3:.2f} ms = {step_s / fl:.2f}x the floor" if step_s else "")
