"""Whole generation steps of a GPTModel with the static decode step, next to the memory-bandwidth floor
(`megatron-cp-bench decode --model`, under torchrun; flags in bench/decode.py).

1. Token check, end to end: a --check-context random prompt is prefilled (ring) and --tokens greedy tokens
   decoded with the step replayed as a CUDA graph, then again eagerly from the same prefill: the tokens must be
   equal, and they must vary (inference/token_check.py: the random model's Q, K are scaled and fc2 centred so
   that they do; constant tokens would be equal under a wrong merge too). Where no graph can run (CPU; gloo, when ranks
   share a GPU) the eager tokens are checked for variety and the comparison is a not-run row.
2. Latency: for each context, batch and decoder, the cache is filled with random K, V as if the context had
   been decoded (no prefill: a 512k prefill would take minutes, and a step reads the same bytes either way),
   the step is captured, and --tokens replays are timed with CUDA events (median, slowest rank). Eager rows
   (--eager-context) run the same step without the graph.
Rows that cannot run here are decided before anything of them is allocated and reported with a one-line reason
(key "not_run"): graph rows without a GPU or on gloo, and configurations whose memory (`config_bytes`) is more
than some rank has free.
floor_ms = (weight bytes this rank reads + its KV shard bytes) / the GPU's memory bandwidth (with the MLPs split
over the CP ranks, --mlp split, a rank reads its share of them); x_floor = ms / floor_ms.
"""
from __future__ import annotations

import contextlib
import gc
import statistics
import time

import torch
import torch.distributed as dist

from megatron_cp_plugin.bench._common import GiB, gather_max, not_fitting, write_report
from megatron_cp_plugin.kernels import _launch

TIMED_WARMUP = 3
VOCAB = 257

# The margin on a configuration's arithmetic (config_bytes). 5 %: free_bytes counts the allocator's cached but
# unused blocks, which may be split into pieces smaller than the cache's K or V tensor (each is one block:
# 64 GiB at 128k, batch 8, CP = 1). 1 GiB: what the first steps allocate beside this arithmetic (cuBLAS
# workspaces of the warm-up stream, Triton's modules, the graph's executable, NCCL's buffers). The case that
# was a traceback row (8B shape, 128k, batch 8, CP = 1, one 139.8 GiB H200, 10.2 GB of weights: 128.05 GiB of
# cache against ~130 GiB free, the second 64 GiB block failed) needs 135.5 GiB with it: refused.
MARGIN_FRACTION = 0.05
MARGIN_BYTES = GiB


def config_bytes(a, *, batch: int, capacity: int, world: int, decoder: str, graphed: bool,
                 prefill_tokens: int = 0, vocab: int = VOCAB) -> int:
    """Bytes one rank needs for one configuration of the bench's model `a` (layers, hidden, ffn, heads,
    kv_heads, head_dim, dtype), margin included, from arithmetic alone (nothing is allocated); e = 2 (bf16) or
    4 bytes:
      cache    StaticCache.bytes_for(layers, batch, capacity, kv_heads, head_dim, e): K, V of capacity + 1
               slots per layer and sequence (bytes_per_token x (capacity + 1)), the positions
      step     one layer's activations b x (6 hidden + (h + 2 h_kv) d + 2 ffn) x 4 B, the logits
               b x vocab x (e + 8) (logits, fp32 copy, sampling), the split-KV workspace (<= 264 programs
               x 64 rows x (d + 1) x 4 B), the allgather merge's P x b h (d + 1) x 4 B; ring decoding (P > 1)
               also one layer's received K, V shard and positions, two in flight for P > 2, plus a contiguous
               copy of the sent shard for b > 1
      graphed  the step twice: the warm-up steps' buffers stay cached in the ordinary pool while the
               captured step allocates its own in the graph's private pool
      prefill  (the token check) per prefilled token on this rank: (6 hidden + (h + 6 h_kv) d + 2 ffn) x 4 B
               of one layer's activations and the ring's K, V blocks, and its logits vocab x (e + 4)
    need = (cache + step (x 2 when graphed) + prefill) x (1 + MARGIN_FRACTION) + MARGIN_BYTES."""
    from megatron_cp_plugin.inference.static import StaticCache

    e = 2 if a.dtype == "bf16" else 4
    h, h_kv, d = a.heads, a.kv_heads, a.head_dim
    cache = StaticCache.bytes_for(a.layers, batch, capacity, h_kv, d, e)
    step = batch * (6 * a.hidden + (h + 2 * h_kv) * d + 2 * a.ffn) * 4 + batch * vocab * (e + 8)
    step += max(264, batch * h_kv) * 64 * (d + 1) * 4 + world * batch * h * (d + 1) * 4
    if decoder == "ring" and world > 1:
        layer_kv = batch * capacity * h_kv * d * e                    # one of K, V of one layer's shard
        step += (1 if world == 2 else 2) * (2 * layer_kv + 8 * batch * capacity) + (2 * layer_kv if batch > 1 else 0)
    prefill = prefill_tokens * ((6 * a.hidden + (h + 6 * h_kv) * d + 2 * a.ffn) * 4 + vocab * (e + 4))
    return int((cache + step * (2 if graphed else 1) + prefill) * (1 + MARGIN_FRACTION) + MARGIN_BYTES)


def latency_capacity(context: int, steps: int, world: int) -> int:
    """Cache slots per rank of a latency row: the context, the warm-up, capture and timed steps, two spare."""
    from megatron_cp_plugin.inference.static import WARMUP_STEPS

    return -(-(context + TIMED_WARMUP + steps + WARMUP_STEPS + 2) // world)


def graph_refusal(dev) -> str | None:
    """Why no CUDA graph can run here (the same on every rank), None where one can."""
    from .. import devices

    if dev.type != "cuda":
        return "not run: a CUDA graph needs a GPU (this run is on the CPU)"
    if not devices.graphs_capture_collectives():
        return ("not run: a CUDA graph cannot capture gloo's collectives (ranks share a GPU: --share-gpu, "
                "MCP_SHARE_GPU=1)")
    return None


def latency_configs(a, dev, world: int) -> list[tuple[int, int, str, str, str | None]]:
    """(context, batch, decoder, mode, why not run or None; the same on every rank) of every latency row, in
    order: graphed rows for each context, batch (> 1 only for tree decoding up to --batch-max-context) and decoder,
    with --pdl both each twice ("graph", then "graph-nopdl": the same step captured without programmatic dependent
    launch); eager rows for each --eager-context and decoder. The sdpa anchor runs at CP = 1 only."""
    no_graph = graph_refusal(dev)
    anchor = "not run: sdpa is the single-GPU anchor (CP = 1 only)" if world > 1 else None
    graph_modes = ("graph", "graph-nopdl") if getattr(a, "pdl", "on") == "both" else ("graph",)

    def why(d: str, graph: bool) -> str | None:
        return (anchor if d == "sdpa" else None) or (no_graph if graph else None)

    out = [(n, b, d, m, why(d, True)) for n in a.context for b in a.batch for d in a.decoders
           if b == 1 or (n <= a.batch_max_context and d == "tree") for m in graph_modes]
    return out + [(n, 1, d, "eager", why(d, False)) for n in a.eager_context for d in a.decoders]


def is_graphed(mode: str) -> bool:
    """Whether a latency row's mode replays a CUDA graph ("graph", "graph-nopdl")."""
    return mode.startswith("graph")


def pdl_note(a) -> str:
    """The report header's sentence on programmatic dependent launch under --pdl."""
    how = getattr(a, "pdl", "on")
    return ("Programmatic dependent launch (kernels/_launch.pdl): " + ("off." if how == "off" else
            "on where the GPU has it" + ("; 'graph-nopdl' rows are the same step without it." if how == "both"
                                         else ".")))


@contextlib.contextmanager
def pdl_for(mode: str):
    """Programmatic dependent launch (kernels/_launch.pdl) off inside the block for a "-nopdl" row, as the run
    has it otherwise (--pdl off clears it for the whole run)."""
    old = _launch.PDL
    _launch.PDL = old and not mode.endswith("-nopdl")
    try:
        yield
    finally:
        _launch.PDL = old


def _build(a, world: int, dev):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_cp_plugin.inference.token_check import vary_greedy_tokens_
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
    model = build_gpt(cfg, CPConfig(algo="ring", cp_size=world), vocab_size=VOCAB,
                      seq_length=max(a.context + a.eager_context + [a.check_context]) + a.tokens + 64, cp_group=group)
    return vary_greedy_tokens_(model.to(dev).eval()), group, ps


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
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def finish(rows: list[dict], out: str, header: str, rank: int, model, ps) -> list[dict]:
    """Rank 0 prints and writes the final report; the model and the model-parallel state go."""
    if rank == 0:
        print(write_report(rows, out, header), flush=True)
    del model
    gc.collect()
    ps.destroy_model_parallel()
    return rows


def model_bench(a, rank: int, world: int, dev, bw: float | None) -> list[dict]:
    """The token check and the latency rows (module docstring); rank 0 prints each row as it comes, keeps the
    report (a.out .json / .md) up to date after each, and prints the table at the end. Returns the rows."""
    from megatron_cp_plugin.inference.floor import bandwidth_note, decode_floor, weight_bytes
    from megatron_cp_plugin.inference.static import StaticDecoder
    from megatron_cp_plugin.inference.token_check import variety

    model, group, ps = _build(a, world, dev)
    weights = weight_bytes(model)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    header = (f"GPTModel decode steps: {a.layers} layers, hidden {a.hidden}, {a.heads} heads, {a.kv_heads} KV "
              f"heads, d {a.head_dim}, ffn {a.ffn} (not gated), vocab {VOCAB}, random {a.dtype} weights "
              f"({weights / 1e9:.2f} GB; made to give varying greedy tokens: inference/token_check.py), "
              f"{world} x {name}, CP = {world}. Latency rows: the KV cache filled with random K, V (no prefill), "
              "the static step (inference/static.py) replayed as one CUDA graph ('graph') or run eagerly; median "
              f"of {a.tokens} steps (eager: a quarter), slowest rank. floor_ms = (the weights this rank reads (its "
              f"share of the MLPs where mlp = split) + its KV shard) "
              f"/ {bandwidth_note(dev, bw)}. not_run: why a row did not run here. " + pdl_note(a))
    rows: list[dict] = []

    def emit(row: dict, line: str) -> None:
        rows.append(row)
        if rank == 0:
            print(line, flush=True)
            write_report(rows, a.out, header)              # kept current: a later failure leaves these rows

    # 1. graph vs eager tokens from one prefill (a fresh decoder each, the same weights and prompt).
    no_graph = graph_refusal(dev)
    modes = ("eager",) if no_graph else ("graph", "eager")
    cap = -(-(a.check_context + a.tokens) // world)
    row = {"what": "tokens graph == eager" if no_graph is None else "tokens vary (eager)",
           "context": a.check_context, "batch": 1, "decoder": "tree", "mode": " vs ".join(modes)}
    why = not_fitting(config_bytes(a, batch=1, capacity=cap, world=world, decoder="tree", graphed=no_graph is None,
                                   prefill_tokens=-(-a.check_context // world)), dev, group)
    if why:
        row["not_run"] = why
        emit(row, f"token check: {why}")
    else:
        prompt = torch.randint(0, VOCAB, (1, a.check_context), generator=torch.Generator().manual_seed(7)).to(dev)
        toks, prefill_s = {}, float("nan")
        for mode in modes:
            dec = StaticDecoder(model, group, batch=1, capacity=cap, graphed=mode == "graph")
            toks[mode] = dec.generate(prompt, max_new_tokens=a.tokens, algo="ring")[0].tolist()
            prefill_s, row["variant"] = dec.timings["prefill_s"], dec.variant
            dec.close()
            dec = None
            _release()
        why = variety(toks["eager"])
        if "graph" in toks and toks["graph"] != toks["eager"]:
            why = "the graphed step's tokens differ from the eager step's"
        row.update(ok=why is None, distinct=len(set(toks["eager"])), **{f"tokens_{m}": t for m, t in toks.items()})
        if why:
            row["why"] = why
        emit(row, f"token check ({row['variant']}): prompt {a.check_context} (prefill ring {prefill_s:.2f} s), "
                  f"{a.tokens} greedy "
                  f"tokens, {row['distinct']} distinct, {row['what']}: {'ok' if why is None else 'FAIL: ' + why}\n"
                  + "\n".join(f"  {m} {t}" for m, t in toks.items()))
    if no_graph:
        emit({"what": "tokens graph == eager", "context": a.check_context, "batch": 1, "decoder": "tree",
              "mode": "graph vs eager", "not_run": no_graph}, f"token check graph == eager: {no_graph}")
    # 2. latency per configuration, the cache filled with random K, V.
    runs = [(*c, v, m, r) for c in latency_configs(a, dev, world)
            for v in (a.variants if c[2] == "tree" and world > 1 and a.variants else [None])
            for m in (a.mlp if world > 1 and a.mlp else [None])
            for r in (a.peer_rounds if world > 1 and a.peer_rounds else [None])
            if r != 1 or (c[2] == "tree" and v in (None, "peer") and m != "whole")]
    for n, b, decoder, mode, refused, variant, mlp, rounds in runs:
        steps = a.tokens if mode == "graph" else max(4, a.tokens // 4)
        cap = latency_capacity(n, steps, world)
        row = {"what": "latency (random K, V cache)", "context": n, "batch": b, "decoder": decoder, "mode": mode}
        if variant is not None:
            row["variant_asked"] = variant
        if mlp is not None:
            row["mlp_asked"] = mlp
        if rounds is not None:
            row["peer_rounds_asked"] = rounds
        # refused is the same on every rank, so either all of them or none take part in not_fitting's gather.
        why = refused or not_fitting(config_bytes(a, batch=b, capacity=cap, world=world, decoder=decoder,
                                                  graphed=is_graphed(mode)), dev, group)
        if why:
            row["not_run"] = why
            emit(row, f"{n:>8} b={b} {decoder:4s} {mode:5s} {why}")
            continue
        with pdl_for(mode):
            try:
                dec = StaticDecoder(model, group, batch=b, capacity=cap, decoder=decoder, graphed=is_graphed(mode),
                                    variant=variant, mlp=mlp, peer_rounds=rounds)
            except ValueError as e:             # peer_rounds=1 where the merge is not "peer": the same on every rank
                if rounds != 1:
                    raise
                row["not_run"] = str(e)
                emit(row, f"{n:>8} b={b} {decoder:4s} {mode:5s} {e}")
                _release()
                continue
            dec.fill_random(n, seed=n)
            dec.tokens.copy_(torch.randint(0, VOCAB, (b, 1), generator=torch.Generator().manual_seed(n)).to(dev))
            ms = _timed(dec, steps)
        kv = -(-(n + steps // 2) // world) * dec.cache.bytes_per_token()
        read = dec.weight_bytes_read()
        floor = decode_floor(read, kv, bw) * 1e3 if bw else float("nan")
        row.update(variant=dec.variant or "-", mlp=dec.mlp, peer_rounds=dec.peer_rounds, ms_per_token=ms,
                   tokens_per_s=b * 1e3 / ms,
                   floor_ms=floor, x_floor=ms / floor, weights_GB=read / 1e9, kv_shard_GB=kv / 1e9)
        dec.close()
        dec = None                                              # the cache goes before the next one is made
        _release()
        emit(row, f"{n:>8} b={b} {decoder:4s} {mode:5s} {row['variant']:10s} mlp {row['mlp']:5s} "
                  f"rounds {row['peer_rounds']} {ms:8.2f} ms/token "
                  f"{row['tokens_per_s']:8.1f} tokens/s  floor {floor:6.2f} ms  x{ms / floor:.2f}")
    for n in a.context:                                         # tree vs ring, graphed, batch 1
        t = {r["decoder"]: r["ms_per_token"] for r in rows if r.get("context") == n and r.get("batch") == 1
             and r.get("mode") == "graph" and "ms_per_token" in r}
        if {"tree", "ring"} <= set(t):                          # (the last tree variant timed)
            emit({"what": "ring / tree (graph, b=1)", "context": n, "ratio": t["ring"] / t["tree"]},
                 f"{n}: ring / tree per token = {t['ring'] / t['tree']:.2f}x")
    return finish(rows, a.out, header, rank, model, ps)
