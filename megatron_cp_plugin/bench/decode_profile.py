"""Where the time of one static decode step goes, per kernel, against the bytes each part must read
(`megatron-cp-bench decode --model --profile`, under torchrun; flags in bench/decode.py).

    torchrun --nproc-per-node 1 -m megatron_cp_plugin.bench decode --model --profile --context 32768 131072 \
        --batch 1 --decoders tree --eager-context --out results/decode_profile_cp1
    torchrun --nproc-per-node 2 -m megatron_cp_plugin.bench decode --model --profile --context 131072 \
        --batch 1 --decoders tree --eager-context --out results/decode_profile_cp2

Each configuration of the latency rows (bench/decode_model.py: context, batch, decoder, graphed or eager; the
cache filled with random K, V) runs under torch.profiler from before its graph is captured (so no CUDA graph
exists before the profiler does) through TIMED_WARMUP steps and --profile-steps measured steps. On a GPU the
measured steps are bounded by marker kernels (`torch.cuda._sleep`, `spin_kernel`, about a microsecond each
but the first, launched between steps): step i is the time from the end of marker i to the start of marker i + 1, and its
kernels, memcpys and memsets (CUPTI sees the kernels of a graph replay one by one) are the device events
between them; on the CPU a step is its record_function range and its "kernels" are its outermost aten ops.
Every kernel falls in one part of the step (`classify`, the table KERNEL_CLASSES: the first pattern that
matches its name); a split-KV combine (`_merge_kernel` right after the attention kernel) is attention.
Per part, a step's mean: us (the kernels' summed durations), n (kernels), share (of the wall time), must_read_MB
(`must_read`: weights of the linear layers for gemm, this rank's filled KV shard for attention, q, k, v for
rope_append, the gathered (o, lse) for exchange and merge, fp32 logits for sampling; copy and other: unknown),
GBps = must_read / us and of_bw = GBps / the floor's bandwidth. Rows busy (the union of the kernels' intervals),
idle (wall - busy: launch gaps, host time, waits between streams) and wall (must_read = the floor's bytes:
all weights + the KV shard, of_bw = floor / wall); events_ms on the wall row is the median step time from CUDA
events (perf_counter on the CPU) in the same run. Every rank reports its own rows; rank 0 writes the report and
each rank its Chrome trace (<out>_traces/*.json.gz, for Perfetto).
"""
from __future__ import annotations

import gzip
import json
import os
import re
import statistics
import time

import torch
import torch.distributed as dist

from megatron_cp_plugin.bench._common import not_fitting, write_report

# Kernel name (CUDA, demangled as CUPTI reports it) or outermost CPU op name -> part of the decode step. Ordered:
# the first pattern that matches (re.search, any case) decides, so the specific come before the general
# (flash-attention's names contain "cutlass", cuDNN's "wgmma"; index_copy is the cache append, not a copy).
KERNEL_CLASSES: dict[str, str] = {
    # The peer kernels (kernels/peer_merge.py, peer_sum.py: the split MLPs' reduce) wait for the peers and read their
    # partials: exchange (and merge, or the sum).
    r"nccl|c10d::|gloo|record_param_comms|\ball_?(gather|reduce)|send_?recv|_peer_(merge|sum)_kernel": "exchange",
    r"(?<![a-z])rope|rotary|index_copy|\b(cos|sin)_kernel|aten::(cos|sin|outer)\b": "rope_append",
    r"_partial_kernel|_deft_|flash|fmha|sdpa|attention|cudnn|aten::(einsum|bmm|baddbmm)\b": "attention",
    r"ArgMax|ArgMin|argmax|softmax|topk|sort|multinomial|cumsum": "sampling",
    r"_merge_kernel|logaddexp|lerp|sigmoid|nan_to_num": "merge",   # merge kernels/merge_; a split-KV combine: attention
    r"nvjet|gemv|gemm|cutlass|xmma|cublas|splitKreduce|s16816|s1688|LinearWith|aten::(linear|addmm|mm|matmul)\b":
        "gemm",
    r"norm|rsqrt|MeanOps|pow_tensor_scalar|RowwiseMoments": "norm",
    r"Memcpy|Memset|copy|CatArray|FillFunctor|fill_|aten::(to|cat|zeros|full|full_like|clone|contiguous)\b": "copy",
}
CATEGORIES = ("gemm", "attention", "rope_append", "norm", "exchange", "merge", "sampling", "copy", "other")
TOTALS = ("busy", "idle", "wall")
STEP = "decode_profile.step"
MARKER = re.compile(r"spin_kernel")
_TABLE = [(re.compile(p, re.IGNORECASE), c) for p, c in KERNEL_CLASSES.items()]


def classify(name: str) -> str:
    """The part of the step a kernel (or outermost CPU op) of this name belongs to: the first match in
    KERNEL_CLASSES, "other" when none matches."""
    return next((c for p, c in _TABLE if p.search(name)), "other")


def classify_all(names: list[str]) -> list[str]:
    """classify() of a step's kernels in launch order, and a merge kernel that directly follows an attention
    kernel is that attention's split-KV combine (flash-decoding's phase 2: kernels/flash_decode.py), not the
    tree merge (which follows the exchange)."""
    out = [classify(n) for n in names]
    for i in range(1, len(out)):
        if out[i] == "merge" and out[i - 1] == "attention":
            out[i] = "attention"
    return out


def busy_us(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of [start, end) intervals clipped to [lo, hi)."""
    total, end = 0.0, lo
    for s, e in sorted(intervals):
        s, e = max(s, end), min(e, hi)
        if e > s:
            total += e - s
            end = e
    return total


def steps_of(events: list[dict], device_index: int | None) -> list[tuple[float, float, list[dict]]]:
    """The measured steps of a Chrome trace's events: (start, end, events of the step) each, events sorted by
    start. device_index None: CPU steps (record_function ranges, their outermost ops); else the device events
    of that GPU between consecutive marker kernels."""
    if device_index is None:
        steps = sorted((e for e in events if e.get("name") == STEP and e.get("cat") == "user_annotation"),
                       key=lambda e: e["ts"])
        ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: (e["ts"], -e["dur"]))
        out = []
        for s in steps:
            lo, hi, top, end = s["ts"], s["ts"] + s["dur"], [], s["ts"]
            for e in ops:
                if e["tid"] == s["tid"] and lo <= e["ts"] and e["ts"] + e["dur"] <= hi and e["ts"] >= end:
                    top.append(e)
                    end = e["ts"] + e["dur"]
            out.append((lo, hi, top))
        return out
    dev = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
                  and e.get("args", {}).get("device", device_index) == device_index), key=lambda e: e["ts"])
    marks = [e for e in dev if MARKER.search(e["name"])]
    rest = [e for e in dev if not MARKER.search(e["name"])]
    out = []
    for m0, m1 in zip(marks, marks[1:]):
        lo, hi = m0["ts"] + m0["dur"], m1["ts"]
        out.append((lo, hi, [e for e in rest if lo <= e["ts"] < hi]))
    return out


def summarize(steps: list[tuple[float, float, list[dict]]]) -> dict[str, tuple[float, float]]:
    """{part: (us, n) per step (means)} for CATEGORIES and busy, idle, wall; busy + idle = wall."""
    if not steps:
        raise ValueError("the profile holds no measured step (no marker kernels or step ranges in the trace)")
    acc = {c: [0.0, 0] for c in CATEGORIES + TOTALS}
    for lo, hi, evs in steps:
        for e, c in zip(evs, classify_all([e["name"] for e in evs])):
            acc[c][0] += e["dur"]
            acc[c][1] += 1
        busy = busy_us([(e["ts"], e["ts"] + e["dur"]) for e in evs], lo, hi)
        acc["busy"][0] += busy
        acc["wall"][0] += hi - lo
        acc["busy"][1] += len(evs)
        acc["wall"][1] += len(evs)
    k = len(steps)
    out = {c: (us / k, n / k) for c, (us, n) in acc.items()}
    out["idle"] = (out["wall"][0] - out["busy"][0], 0.0)
    return out


def must_read(model, dec, kv_tokens: int, vocab: int) -> dict[str, int | None]:
    """Bytes each part of one step must read on this rank (None: not known from the shapes); "wall": the floor's
    (the weights this rank reads, its share of split MLPs, and its KV shard of kv_tokens tokens, as the latency
    rows count it)."""
    gemm = norm = emb = 0
    for name, p in model.named_parameters():           # each shared tensor once
        nb = p.numel() * p.element_size()
        if "norm" in name:
            norm += nb
        elif "embedding" in name:
            emb += nb
        else:
            gemm += nb
    gpt = getattr(model, "module", model)
    if getattr(gpt, "share_embeddings_and_output_weights", False):
        gemm += emb                                    # the output layer reads the embedding table
    L, b, P = len(dec.owners), dec.batch, dec.world
    h, h_kv, d, e = dec.heads, dec.kv_heads, dec.head_dim, dec.cache.k.element_size()
    hidden = gpt.config.hidden_size
    per_token = dec.cache.bytes_per_token()
    kv = kv_tokens * per_token
    partials = L * P * b * h * (d + 1) * 4 if P > 1 else 0          # every rank's (o, lse), fp32, per layer
    if dec.decoder == "ring":      # every shard at full capacity, P - 1 of them received with their positions
        attn, exchange = P * dec.cache.capacity * per_token, (P - 1) * dec.cache.capacity * (per_token + 8 * b * L)
    else:
        attn, exchange = kv, partials
    if dec.split is not None:          # this rank's MLP shares, and every rank's fp32 fc2 partial a layer
        gemm -= dec.split.weight_bytes_saved()
        exchange += L * P * b * hidden * 4
    return {"gemm": gemm, "attention": attn, "rope_append": L * b * (h + 2 * h_kv) * d * e,
            "norm": norm + (2 * L + 1) * b * hidden * e, "exchange": exchange, "merge": partials,
            "sampling": b * vocab * 4, "copy": None, "other": None, "busy": None, "idle": None,
            "wall": dec.weight_bytes_read() + kv}


def _us(x: float):
    """Microseconds as reported: whole from 100 up, one decimal below."""
    return round(x) if abs(x) >= 100 else round(x, 1)


def rows_of(parts: dict, need: dict, bw: float | None, key: dict, events_ms: float) -> list[dict]:
    """One report row per part of the step (CATEGORIES, then busy, idle, wall), `key` columns first."""
    wall = parts["wall"][0]
    rows = []
    for c in CATEGORIES + TOTALS:
        us, n = parts[c]
        nb = need[c]
        row = {**key, "part": c, "us": _us(us), "n": n, "share": us / wall if wall else float("nan"),
               "must_read_MB": "" if nb is None else nb / 1e6}
        gbps = nb / us / 1e3 if nb and us > 0 else None
        row["GBps"] = "" if gbps is None else gbps
        row["of_bw"] = "" if gbps is None or not bw else gbps * 1e9 / bw
        if c == "wall":
            row["events_ms"] = events_ms
        rows.append(row)
    return rows


def _marker(dev, cycles: int = 100) -> None:
    """A step boundary on the device: spin_kernel (~1 us at 100 cycles). The first one spins ~0.1 ms, so that
    the host has queued the first measured step before the device gets to it (none of it counts: a step starts
    where its marker ends)."""
    if dev.type == "cuda":
        torch.cuda._sleep(cycles)


def profile_steps(dec, steps: int, warmup: int, trace: str) -> tuple[list[dict], float]:
    """Run warmup steps (the first captures a graphed step) and `steps` measured steps under torch.profiler,
    every rank starting the measured ones together; write the Chrome trace to `trace` (.json.gz). Returns the
    trace's events and the median step ms from CUDA events (perf_counter on the CPU)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = dec.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with profile(activities=acts) as prof:
        for _ in range(warmup):
            dec.step()
        sync()
        dist.barrier()
        stamps = []
        for i in range(steps + 1):
            _marker(dec.device, 200_000 if i == 0 else 100)
            if cuda:
                stamps.append(torch.cuda.Event(enable_timing=True))
                stamps[-1].record()
            else:
                stamps.append(time.perf_counter())
            if i < steps:
                with record_function(STEP):
                    dec.step()
        sync()
    ms = ([a.elapsed_time(b) for a, b in zip(stamps, stamps[1:])] if cuda
          else [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])])
    os.makedirs(os.path.dirname(trace) or ".", exist_ok=True)
    prof.export_chrome_trace(trace)
    with gzip.open(trace, "rt") as f:
        return json.load(f)["traceEvents"], statistics.median(ms)


def profile_bench(a, rank: int, world: int, dev, bw: float | None) -> list[dict]:
    """The profile rows of every latency configuration (module docstring); rank 0 prints a line per
    configuration, keeps the report (a.out .json / .md) current and prints the table at the end."""
    from megatron_cp_plugin.bench.decode_model import (TIMED_WARMUP, VOCAB, _build, _release, config_bytes,
                                                       finish, is_graphed, latency_capacity, latency_configs,
                                                       pdl_for, pdl_note)
    from megatron_cp_plugin.inference.floor import bandwidth_note
    from megatron_cp_plugin.inference.static import StaticDecoder

    if a.profile_steps < 1:
        raise SystemExit(f"--profile-steps must be at least 1, got {a.profile_steps}")
    model, group, ps = _build(a, world, dev)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    header = (f"Decode step profile: GPTModel {a.layers} layers, hidden {a.hidden}, {a.heads} heads, {a.kv_heads} "
              f"KV heads, d {a.head_dim}, ffn {a.ffn}, vocab {VOCAB}, {a.dtype}; {world} x {name}, CP = {world}; "
              f"the static step on a random K, V cache, {a.profile_steps} steps under torch.profiler (means per "
              "step, each rank). part: kernels by name (bench/decode_profile.KERNEL_CLASSES); busy: union of "
              "their intervals; idle = wall - busy; must_read_MB: bytes the part must read (exchange, merge: "
              f"the gathered (o, lse)); GBps = must_read / us; of_bw = GBps / the floor's bandwidth, "
              f"{bandwidth_note(dev, bw)}; wall's must_read = the floor's bytes; events_ms: median step from "
              "CUDA events (perf_counter on the CPU). " + pdl_note(a))
    rows: list[dict] = []
    trace_dir = a.out + "_traces"
    for n, b, decoder, mode, refused in latency_configs(a, dev, world):
        key = {"context": n, "batch": b, "decoder": decoder, "mode": mode}
        cap = latency_capacity(n, a.profile_steps + TIMED_WARMUP, world)
        why = refused or not_fitting(config_bytes(a, batch=b, capacity=cap, world=world, decoder=decoder,
                                                  graphed=is_graphed(mode)), dev, group)
        if why:
            rows.append({**key, "not_run": why})
            if rank == 0:
                print(f"{n:>8} b={b} {decoder:4s} {mode:5s} {why}", flush=True)
                write_report(rows, a.out, header)
            continue
        trace = os.path.join(trace_dir, f"{n}_b{b}_{decoder}_{mode}_rank{rank}.json.gz")
        with pdl_for(mode):
            dec = StaticDecoder(model, group, batch=b, capacity=cap, decoder=decoder, graphed=is_graphed(mode),
                                mlp=(a.mlp or [None])[0])
            dec.fill_random(n, seed=n)
            dec.tokens.copy_(torch.randint(0, VOCAB, (b, 1), generator=torch.Generator().manual_seed(n)).to(dev))
            events, ev_ms = profile_steps(dec, a.profile_steps, TIMED_WARMUP, trace)
        kv_tokens = -(-(n + TIMED_WARMUP + a.profile_steps // 2) // world)
        steps = steps_of(events, torch.cuda.current_device() if dev.type == "cuda" else None)
        if len(steps) == a.profile_steps:
            mine = rows_of(summarize(steps), must_read(model, dec, kv_tokens, VOCAB), bw,
                           {**key, "variant": dec.variant or "-", "rank": rank}, ev_ms)
        else:                                       # e.g. the profiler saw no kernels: say so, go on
            mine = [{**key, "rank": rank, "error": f"{len(steps)} measured steps found in the trace "
                     f"({trace}), {a.profile_steps} expected"}]
        dec.close()
        dec = None
        _release()
        everyone = [None] * world
        dist.all_gather_object(everyone, mine, group=group)
        rows += [r for rs in everyone for r in rs]
        if rank == 0:
            print(f"{n:>8} b={b} {decoder:4s} {mode:5s} {mine[0].get('error') or _line(mine)}", flush=True)
            write_report(rows, a.out, header)
    return finish(rows, a.out, header, rank, model, ps)


def _line(rows: list[dict]) -> str:
    """One printed line: the wall, busy and idle, and the parts that took time, largest first."""
    by = {r["part"]: r for r in rows}
    top = sorted((r for r in rows if r["part"] in CATEGORIES and r["us"] > 0), key=lambda r: -r["us"])
    parts = ", ".join(f"{r['part']} {r['us']:.0f}" + (f" ({r['GBps']:.0f} GB/s)" if r["GBps"] != "" else "")
                      for r in top)
    return (f"wall {by['wall']['us']:.0f} us (busy {by['busy']['us']:.0f}, idle {by['idle']['us']:.0f}; "
            f"events {by['wall']['events_ms'] * 1e3:.0f}): {parts}")
