"""Shared benchmark plumbing: process-group set-up under torchrun, CUDA-event timing, attention FLOPs, reports."""
from __future__ import annotations

import json
import os
import statistics
import sys

import torch
import torch.distributed as dist


def init_distributed():
    """Under torchrun: NCCL on GPUs (one per local rank), gloo on CPU, gloo with CUDA tensors when ranks share
    GPUs (devices.py; more local ranks than GPUs without MCP_SHARE_GPU=1 / --share-gpu: one line, exit 2).
    Returns (rank, world, device)."""
    from .. import devices

    from ..comm import init_group

    lone = "RANK" not in os.environ        # python -m ... without torchrun: one rank with a store of its own
    if lone:                               # (a fixed port collided with any other benchmark on the machine)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    share = devices.sharing()
    devices.refuse_unshared_ranks("megatron-cp-bench", share)
    dev = devices.rank_device(int(os.environ["LOCAL_RANK"]))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = devices.backend(share)
    extra = {"device_id": dev} if backend == "nccl" else {}
    if lone:
        init_group(backend, 0, 1, **extra)
    else:
        dist.init_process_group(backend, **extra)
    return dist.get_rank(), dist.get_world_size(), dev


GiB = 2**30


def free_bytes(device) -> int | None:
    """Bytes a new allocation can still get on `device`: what CUDA reports free plus what torch's allocator
    holds cached but unused (it hands those out first); on a CPU the memory the system has available (psutil),
    None where that is unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        import psutil
    except ImportError:
        return None
    return psutil.virtual_memory().available


def not_fitting(need: float, device, group=None) -> str | None:
    """Whether a configuration needing `need` more bytes on each rank can run, decided before anything of it is
    allocated: None when it fits on every rank, else the one-line reason every rank then reports ("not run:
    needs 128.6 GiB of 73.2 GiB free on NVIDIA H200"). With torch.distributed up, every rank of `group`
    takes part (one all-gather), so that all of them skip the same configurations and none waits in a
    collective for a rank that skipped; ranks sharing one GPU (--share-gpu) add their needs up against it."""
    import platform

    free = free_bytes(device)
    where = (platform.node(), str(device) if device.type == "cuda" else f"cpu{os.getpid()}")
    mine = (float(need), float("inf") if free is None else float(free), where)
    if dist.is_available() and dist.is_initialized():
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    else:
        everyone = [mine]
    per_device: dict = {}
    for n, f, key in everyone:
        total, least = per_device.get(key, (0.0, float("inf")))
        per_device[key] = (total + n, min(least, f))
    need_max, free_min = max(per_device.values(), key=lambda nf: nf[0] - nf[1])
    if need_max <= free_min:
        return None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "this CPU"
    return f"not run: needs {need_max / GiB:.1f} GiB of {free_min / GiB:.1f} GiB free on {name}"


def timing_note() -> str:
    """What a report says of its timings beside the device: empty, or that ranks shared a GPU."""
    from .. import devices

    return f" ({devices.NOT_REPRESENTATIVE})" if devices.shares_gpu(devices.sharing()) else ""


def gather_max(x: float) -> float:
    """The largest of every rank's x (the slowest rank sets a step's time)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return max(out)


def time_ms(fn, *, warmup: int = 3, iters: int = 10, before=None) -> float:
    """Median wall time of fn() in ms: CUDA events around each call after `warmup` calls (perf_counter on CPU).
    before(), untimed, runs ahead of each timed call (e.g. a barrier so that every rank starts together)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            import time
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


FLOP_FORMULA = ("fwd FLOP = 4 * b * h * S^2 * d * (1/2 if causal); fwd+bwd = 3.5 x fwd "
                "(backward recomputes QK^T and does 4 more matmuls of that size)")


def attention_flop(b: int, s: int, h: int, d: int, causal: bool, backward: bool) -> float:
    f = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    return f * 3.5 if backward else f


def write_report(rows: list[dict], path_stem: str, header: str, plot: tuple[str, str, str] | dict | None = None,
                 draw: bool = True) -> str:
    """Write rows as JSON and a markdown table (path_stem.json, path_stem.md), and with `plot` a PNG
    (path_stem.png; needs matplotlib, else `megatron-cp-bench plot` draws it later from the JSON): a figure kind
    of bench/plots.py ({"kind": "attention"}, {"kind": "rank"}) or (x, y, series) column names, one log-log line
    per series. draw=False: the JSON names the figure, none is drawn (a report rewritten after every row).
    Returns the markdown. The JSON keeps the exact command and the device. Rows of configurations that did not
    run (a `not_run` reason, e.g. not_fitting's line) keep their place, with the reason in the last column and
    the measured columns empty, and get no bar or point in the figure."""
    os.makedirs(os.path.dirname(path_stem) or ".", exist_ok=True)
    cols = list(dict.fromkeys(c for r in rows for c in r if c != "not_run"))
    cols += ["not_run"] if any("not_run" in r for r in rows) else []
    header += timing_note()
    md = [header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        md.append("| " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |")
    text = "\n".join(md) + "\n"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    with open(path_stem + ".json", "w") as f:
        json.dump({"header": header, "command": " ".join(sys.argv), "device": device, "plot": plot, "rows": rows},
                  f, indent=1)
    with open(path_stem + ".md", "w") as f:
        f.write(text)
    if plot is not None and draw:
        from .plots import draw as draw_figure
        draw_figure(rows, path_stem + ".png", plot, header=header, device=device)
    return text


def _cell(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def plot_rows(rows, png: str, x: str, y: str, series: str, title: str = ""):
    """A log-log line per `series` value of y against x: bench/plots.py's (kept here for its callers)."""
    from .plots import plot_rows as lines

    return lines(rows, png, x, y, series, title=title)
