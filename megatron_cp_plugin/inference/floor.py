"""The memory-bandwidth floor of a decode step, and the GPU figures it needs.

At batch sizes of a few sequences a decode step is memory-bound: every rank reads all of its weights (under
context parallelism every rank holds them all) and its own KV shard once per step, so no step can be faster
than (weight bytes + this rank's KV shard bytes) / the GPU's memory bandwidth. The bandwidth is measured on the
GPU the step runs on, in the same run: the higher of a device-to-device copy (read + write counted) and a
read-only reduction, the most a kernel of torch's reaches there (one H100, 2026-11-26: copy 2.99, read 3.05 TB/s,
against 3.35 nominal; H200 ~4.3 against 4.8). The nominal figure (the vendor's) is reported beside it.
"""
from __future__ import annotations

import torch

# The vendors' figures (bytes/s, SXM parts), by a substring of torch.cuda.get_device_name(): reported, not used.
NOMINAL_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}
_MEASURED: dict[int, dict] = {}


def _median_s(fn) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Measured bytes/s of a device-to-device copy of `nbytes` (read + write counted), median of 10. With 256 MiB
    (and a 256 MiB read) one H100 gave 2.81 and 2.50 TB/s where our attention kernel reads at 3.0: too small."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_s(lambda: dst.copy_(src))


def read_bandwidth(device: torch.device, nbytes: int = 1 << 31) -> float:
    """Measured bytes/s of reading `nbytes` of bf16 once (an fp32 sum), median of 10."""
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    return nbytes / _median_s(lambda: x.sum(dtype=torch.float32))


def nominal_bandwidth(device: torch.device) -> float | None:
    """The vendor's figure for this GPU (NOMINAL_BANDWIDTH), None where unknown or on a CPU."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((bw for key, bw in NOMINAL_BANDWIDTH.items() if key in name), None)


def memory_bandwidth(device: torch.device, override: float | None = None) -> float | None:
    """The floor's bandwidth in bytes/s: `override`, else measured now on `device` (the higher of a copy and a
    read; bandwidth_note says which and the nominal), None on a CPU."""
    if override is not None:
        if not override > 0:
            raise ValueError(f"memory bandwidth must be positive, got {override}")
        return override
    if device.type != "cuda":
        return None
    try:
        m = {"copy": copy_bandwidth(device), "read": read_bandwidth(device), "nominal": nominal_bandwidth(device)}
    except torch.OutOfMemoryError:                    # beside a full cache (the generate CLI measures after its run)
        m = {"copy": copy_bandwidth(device, 1 << 28), "read": read_bandwidth(device, 1 << 28),
             "nominal": nominal_bandwidth(device)}
    torch.cuda.empty_cache()
    _MEASURED[torch.device(device).index or 0] = m
    return max(m["copy"], m["read"])


def bandwidth_note(device: torch.device, bw: float | None) -> str:
    """One phrase on where the floor's bandwidth came from: measured here (copy, read) or given, and the nominal."""
    if bw is None:
        return "no bandwidth on a CPU"
    m = _MEASURED.get(torch.device(device).index or 0) if device.type == "cuda" else None
    nominal = nominal_bandwidth(device)
    nom = f"; nominal {nominal / 1e12:.2f} TB/s" if nominal else ""
    if m is None or bw != max(m["copy"], m["read"]):
        return f"{bw / 1e12:.2f} TB/s as given (--mem-bw){nom}"
    return (f"{bw / 1e12:.2f} TB/s measured in this run (copy {m['copy'] / 1e12:.2f}, read {m['read'] / 1e12:.2f} "
            f"TB/s){nom}")


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
