"""Whole generation steps of a GPTModel with the static decode step, next to the memory-bandwidth floor
(`megatron-cp-bench decode --model`, under torchrun; flags in bench/decode.py).

1. Token check, end to end: a --check-context random prompt is prefilled (ring) and 32 tokens decoded with
   the step replayed as a CUDA graph, then again eagerly from the same prefill: the tokens must be equal.
2. Latency: for each context, batch and decoder, the cache is filled with random K, V as if the context had
   been decoded (no prefill: a 512k prefill would take minutes, and a step reads the same bytes either way),
   the step is captured, and --tokens replays are timed with CUDA events (median, slowest rank). Eager rows
   (--eager-context) run the same step without the graph.
floor_ms = (weight bytes + this rank's KV shard bytes) / the GPU's memory bandwidth; x_floor = ms / floor_ms.
"""
from __future__ import annotations

import gc
import statistics
import time

import torch
import torch.distributed as dist

from megatron_cp_plugin.bench._common import gather_max, write_report

TIMED_WARMUP = 3


def _build(a, world: int, dev):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_cp_plugin.megatron import CPConfig
    from megatron_cp_plugin.megatron.model import build_gpt

    ps.initialize_model_parallel(context_parallel_size=world)
    torch.manual_seed(1234)
    if dev.type == "cuda":
        model_parallel_cuda_manual_seed(1234)
    bf16 = a.dtype == "bf16"
    cfg = TransformerConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                            num_query_groups=a.kv_heads, ffn_hidden_size=a.ffn, kv_channels=a.head_dim,
                            normalization="RMSNorm", bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
                            attention_dropout=0.0, hidden_dropout=0.0, context_parallel_size=world,
                            use_cpu_initialization=dev.type == "cpu")
    group = ps.get_context_parallel_group()
    model = build_gpt(cfg, CPConfig(algo="ring", cp_size=world), vocab_size=257,
                      seq_length=max(a.context + [a.check_context]) + a.tokens + 64, cp_group=group)
    return model.to(dev).eval(), group, ps


def _timed(dec, steps: int) -> float:
    """Median ms of one decode step over `steps` steps after TIMED_WARMUP, every rank starting together; the
    slowest rank's. CUDA events between steps: no host sync inside the timed loop."""
    for _ in range(TIMED_WARMUP):
        dec.step()
    dist.barrier()
    cuda = dec.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        ev[0].record()
        for i in range(steps):
            dec.step()
            ev[i + 1].record()
        ev[-1].synchronize()
        ms = [x.elapsed_time(y) for x, y in zip(ev, ev[1:])]
    else:
        stamps = [time.perf_counter()]
        for _ in range(steps):
            dec.step()
            stamps.append(time.perf_counter())
        ms = [(y - x) * 1e3 for x, y in zip(stamps, stamps[1:])]
    return gather_max(statistics.median(ms))


def _release() -> None:
    """Return the freed cache and graph memory, so that the next configuration's cache fits."""
    gc.collect()
    torch.cuda.empty_cache()


def model_bench(a, rank: int, world: int, dev, bw: float) -> None:
    from megatron_cp_plugin.inference.floor import decode_floor, weight_bytes
    from megatron_cp_plugin.inference.static import WARMUP_STEPS, StaticDecoder

    model, group, ps = _build(a, world, dev)
    weights = weight_bytes(model)
    rows = []
    # 1. graph vs eager tokens from one prefill (a fresh decoder each, the same weights and prompt).
    prompt = torch.randint(0, 257, (1, a.check_context), generator=torch.Generator().manual_seed(7)).to(dev)
    toks = {}
    from .. import devices
    modes = ("graph", "eager") if dev.type == "cuda" and devices.graphs_capture_collectives() else ("eager",)
    for mode in modes:
        dec = StaticDecoder(model, group, batch=1, capacity=-(-(a.check_context + a.tokens) // world),
                            graphed=mode == "graph")
        try:
            toks[mode] = dec.generate(prompt, max_new_tokens=a.tokens, algo="ring").tolist()
        except Exception as e:  # noqa: BLE001 - the latency rows still run; the report names the failure
            toks[mode] = [[f"{type(e).__name__}: {str(e)[:300]}"]]
        prefill_s = dec.timings.get("prefill_s", float("nan"))
        dec.close()
        dec = None
        _release()
    same = toks.get("graph", toks["eager"]) == toks["eager"]
    if rank == 0:
        print(f"token check: prompt {a.check_context} (prefill ring {prefill_s:.2f} s), {a.tokens} greedy tokens, "
              f"graph == eager: {same}\n" + "".join(f"  {m} {t[0]}\n" for m, t in toks.items()), flush=True)
    rows.append({"what": "tokens graph == eager", "context": a.check_context, "batch": 1, "decoder": "tree",
                 "mode": " vs ".join(modes), "ok": same, **{f"tokens_{m}": t[0] for m, t in toks.items()}})
    # 2. latency per configuration, the cache filled with random K, V.
    configs = [(n, b, d, "graph") for n in a.context for b in a.batch for d in a.decoders
               if (b == 1 or (n <= a.batch_max_context and d == "tree")) and dev.type == "cuda"]
    configs += [(n, 1, d, "eager") for n in a.eager_context for d in a.decoders]
    for n, b, decoder, mode in configs:
        steps = a.tokens if mode == "graph" else max(4, a.tokens // 4)
        cap = -(-(n + TIMED_WARMUP + steps + WARMUP_STEPS + 2) // world)
        row = {"what": "latency (random K, V cache)", "context": n, "batch": b, "decoder": decoder, "mode": mode}
        dec = None
        try:
            dec = StaticDecoder(model, group, batch=b, capacity=cap, decoder=decoder, graphed=mode == "graph")
            dec.fill_random(n, seed=n)
            dec.tokens.copy_(torch.randint(0, 257, (b, 1), generator=torch.Generator().manual_seed(n)))   # replicated
            ms = _timed(dec, steps)
        except Exception as e:  # noqa: BLE001 - report the configuration that failed (OOM, capture), go on
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            if rank == 0:
                print(f"{n:>8} b={b} {decoder:4s} {mode:5s} failed: {row['error']}", flush=True)
        else:
            kv = -(-(n + steps // 2) // world) * dec.cache.bytes_per_token()
            floor = decode_floor(weights, kv, bw) * 1e3 if bw else float("nan")
            row.update(variant=dec.variant or "-", ms_per_token=ms, tokens_per_s=b * 1e3 / ms, floor_ms=floor,
                       x_floor=ms / floor, weights_GB=weights / 1e9, kv_shard_GB=kv / 1e9)
            rows.append(row)
            if rank == 0:
                print(f"{n:>8} b={b} {decoder:4s} {mode:5s} {row['variant']:10s} {ms:8.2f} ms/token "
                      f"{row['tokens_per_s']:8.1f} tokens/s  floor {floor:6.2f} ms  x{ms / floor:.2f}", flush=True)
        if dec is not None:
            dec.close()
        dec = None                                              # the cache goes before the next one is made
        _release()
    for n in a.context:                                         # tree vs ring, graphed, batch 1
        t = {r["decoder"]: r["ms_per_token"] for r in rows if r.get("context") == n and r.get("batch") == 1
             and r.get("mode") == "graph" and "ms_per_token" in r}
        if {"tree", "ring"} <= set(t) and rank == 0:
            print(f"{n}: ring / tree per token = {t['ring'] / t['tree']:.2f}x", flush=True)
            rows.append({"what": "ring / tree (graph, b=1)", "context": n, "ratio": t["ring"] / t["tree"]})
    if rank == 0:
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
        header = (f"GPTModel decode steps: {a.layers} layers, hidden {a.hidden}, {a.heads} heads, {a.kv_heads} KV "
                  f"heads, d {a.head_dim}, ffn {a.ffn} (not gated), vocab 257, random {a.dtype} weights "
                  f"({weights / 1e9:.2f} GB), {world} x {name}, CP = {world}. Latency rows: the KV cache filled "
                  "with random K, V (no prefill), the static step (inference/static.py) replayed as one CUDA "
                  f"graph ('graph') or run eagerly; median of {a.tokens} steps (eager: a quarter), slowest rank. "
                  f"floor_ms = (weights + this rank's KV shard) / {(bw or float('nan')) / 1e12:.2f} TB/s.")
        print(write_report(rows, a.out, header), flush=True)
    del model
    gc.collect()
    ps.destroy_model_parallel()
