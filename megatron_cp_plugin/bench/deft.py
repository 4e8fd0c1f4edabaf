"""Tree-decode attention per decode step: DeFT-Flatten / -Node / -Node-Chunk against Q-guided baselines and
Medusa-style dense-mask tree attention, on the paper's three workloads (deft.txt, Sec. 4, Tables 5-6, 13).

    python -m megatron_cp_plugin.bench.deft                       # one GPU; --workloads fewshot reasoning spec
    TRITON_INTERPRET=1 python -m megatron_cp_plugin.bench.deft --tiny     # CPU smoke run (fp32, tiny shapes)

Workloads (one decode step of a snapshot tree; the KV pool is paged with shuffled slots):
  fewshot    a --prompt-token prompt and b branches (--branches) of --generated tokens each; one query a branch;
  reasoning  ToT-BFS: --tot-depth levels, --tot-width states kept a level, --tot-branch thoughts grown from
             each, thoughts of ~--thought tokens (pruned ones gone); one query per thought being generated;
  spec       speculative decoding: a --prefix-token sequence and a Medusa-topology token tree of t tokens
             (--tree-tokens), every tree token a query that sees its ancestors (causal by tree topology).
Methods: DeFT with its three groupings and the same kernel with Q-guided grouping (a paged Flash-Decoding /
Radix Attention: every query reads its whole path through the page table); Flash-Decoding-style gather + SDPA
(each query's path copied out of the pool, then attention); Medusa-style (all tree tokens from an unpaged
contiguous cache, gathered outside the timing, one GEMM, a dense [n_q, n_kv] additive mask, softmax, GEMM).
Per layer, median of --iters CUDA-event timings after warm-up. Byte formulas in the report's header. A
workload whose memory (`case_bytes`, with decode_model's margin) is more than the device has free is a row with
its one-line reason ("not_run"), decided before anything of it is allocated.
"""
from __future__ import annotations

import argparse
import random

import torch

from megatron_cp_plugin.bench._common import not_fitting, time_ms, write_report
from megatron_cp_plugin.inference.tree import medusa_topology
from megatron_cp_plugin.kernels import deft
from megatron_cp_plugin.kernels.deft_reference import (dense_tree_mask, flash_decoding_baseline,
                                                        medusa_tree_attention, query_paths, tree_attention_reference)

DEFT_METHODS = {"DeFT-Flatten": "flatten", "DeFT-Node": "node", "DeFT-Node-Chunk": "node_chunk",
                "Q-guided paged (Radix/FD)": "qguided"}


def fewshot_shape(prompt: int, branches: int, generated: int):
    """(parents, node lengths, query nodes, query seen): a prompt and `branches` children."""
    return [-1] + [0] * branches, [prompt] + [generated] * branches, list(range(1, branches + 1)), None


def tot_shape(prompt: int, depth: int, width: int, branch: int, thought: int, seed: int = 0):
    """A ToT-BFS snapshot: `depth - 1` finished levels of kept thoughts, then `branch` thoughts being generated
    from each of the `width` kept states (partly written); pruned thoughts are gone from the cache."""
    rng = random.Random(seed)
    parents, lens, frontier = [-1], [prompt], [0]
    for _ in range(depth - 1):
        cands = [s for s in frontier for _ in range(branch)]
        kept = sorted(rng.sample(range(len(cands)), min(width, len(cands))))
        frontier = []
        for c in kept:
            parents.append(cands[c]), lens.append(rng.randint(thought // 2, thought * 3 // 2))
            frontier.append(len(parents) - 1)
    queries = []
    for s in frontier:
        for _ in range(branch):
            parents.append(s), lens.append(rng.randint(1, thought))
            queries.append(len(parents) - 1)
    return parents, lens, queries, None


def spec_shape(prefix: int, t: int):
    """A prefix node and a Medusa-topology tree of t one-token nodes; each tree token a query."""
    return [-1] + [0 if p < 0 else p + 1 for p in medusa_topology(t)], [prefix] + [1] * t, list(range(1, t + 1)), \
        [1] * t


GATHER_CHUNK = 1 << 30          # flash_decoding_baseline's chunk_bytes default


def path_lengths(shape, nodes: bool = False) -> list[int]:
    """Tokens each query sees (its ancestors whole, its own node up to its seen count), from the shape alone;
    with nodes=True the nodes on each query's path instead."""
    parents, lens, qn, qs = shape
    out = []
    for i, u in enumerate(qn):
        n, k, a = (lens[u] if qs is None else qs[i]), 1, parents[u]
        while a >= 0:
            n, k, a = n + lens[a], k + 1, parents[a]
        out.append(k if nodes else n)
    return out


def case_bytes(shape, *, h: int, h_kv: int, d: int, e: int, check_queries: int = 16) -> int:
    """Bytes one workload needs on the device, from its shape alone (nothing allocated), with decode_model's
    margin; e = bytes per element. Held through the case: q, the paged K, V pool (num_slots = tokens x 9/8),
    Medusa's unpaged K, V copy and its [n_q, n_kv] mask, the paths' slot indices. Then the largest of what one
    method adds while it runs: the fp32 reference (the pool in fp32, the first 16 queries' gathered K, V and
    scores), gather + SDPA (chunks of 1 GiB of gathered K, V, or one query's path, twice for SDPA's copies), Medusa's
    [h, n_q, n_kv] scores (the scores, the mask's bias, fp32 softmax, its cast: 3 e + 4 B), DeFT's fp32 (o, lse)
    partials (at most one per query and 64-key block of its path, or per node on it)."""
    from megatron_cp_plugin.bench.decode_model import MARGIN_BYTES, MARGIN_FRACTION

    _, lens, qn, _ = shape
    n_tok, n_q, tok = sum(lens), len(qn), h_kv * d
    paths = path_lengths(shape)
    held = (n_q * h * d + 2 * (n_tok + n_tok // 8 + 1) * tok + 2 * n_tok * tok) * e + n_q * n_tok * (1 + e)
    held += 8 * sum(paths)
    ref = (n_tok + n_tok // 8 + 1) * tok * 4 + min(check_queries, n_q) * max(paths) * (2 * tok + 2 * h) * 4
    gather = 2 * min(2 * sum(paths) * tok * e, max(GATHER_CHUNK, 2 * max(paths) * tok * e))
    medusa = h * n_q * n_tok * (3 * e + 4)
    deft_parts = 2 * (sum(paths) // 64 + sum(path_lengths(shape, nodes=True))) * h * (d + 1) * 4
    return int((held + max(ref, gather, medusa, deft_parts)) * (1 + MARGIN_FRACTION) + MARGIN_BYTES)


def make_case(shape, *, h: int, h_kv: int, d: int, dtype, device, seed: int = 0):
    """Random q, a paged pool with the tree's tokens at shuffled slots, and the tree's page table."""
    parents, lens, qn, qs = shape
    n_tok = sum(lens)
    num_slots = n_tok + n_tok // 8 + 1                               # spare slots: a pool is never full
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_slots, generator=g)
    node_slots, o = [], 0
    for n in lens:
        node_slots.append(perm[o:o + n])
        o += n
    gd = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(len(qn), h, d, device=device, dtype=dtype, generator=gd)
    k, v = (torch.randn(num_slots, h_kv, d, device=device, dtype=dtype, generator=gd) for _ in range(2))
    return dict(parents=parents, node_slots=node_slots, qn=qn, qs=qs, num_slots=num_slots, q=q, k=k, v=v,
                n_tok=n_tok)


def copy_bandwidth(device, nbytes: int) -> float:
    """Measured device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    t = time_ms(lambda: dst.copy_(src), warmup=3, iters=10)
    return 2 * nbytes / (t * 1e-3)


def run_case(name: str, c: dict, *, iters: int, bw: float, check_queries: int = 16) -> list[dict]:
    q, k, v = c["q"], c["k"], c["v"]
    n_q, h, d = q.shape
    h_kv, e = k.shape[1], k.element_size()
    tok_bytes = 2 * h_kv * d * e                                    # K and V of one token, one layer
    floor_s = c["n_tok"] * tok_bytes / bw
    paths = query_paths(c["parents"], c["node_slots"], c["qn"], c["qs"])
    path_tok = sum(p.numel() for p in paths)
    dev_paths = [p.to(q.device) for p in paths]
    ref_idx = list(range(min(check_queries, n_q)))
    ref = tree_attention_reference(q[ref_idx], k, v, [dev_paths[i] for i in ref_idx], dtype=torch.float32)[0]
    fns, kv_read, partial = {}, {}, {}
    for label, strategy in DEFT_METHODS.items():
        plan = deft.plan_deft(c["parents"], c["node_slots"], c["qn"], c["qs"], num_heads=h, num_kv_heads=h_kv,
                              num_slots=c["num_slots"], strategy=strategy, device=q.device)
        fns[label] = (lambda plan=plan: deft.deft_attention(q, k, v, plan)[0])
        kv_read[label] = plan.kv_tokens_loaded() * tok_bytes
        partial[label] = 2 * plan.q_ent.numel() * h * (d + 1) * 4     # fp32 (o, lse) per (query, item): w + r
    fns["Flash-Decoding-style (gather+SDPA)"] = lambda: flash_decoding_baseline(q, k, v, dev_paths)
    kv_read["Flash-Decoding-style (gather+SDPA)"] = 2 * path_tok * tok_bytes        # the gather's read, SDPA's
    partial["Flash-Decoding-style (gather+SDPA)"] = path_tok * tok_bytes            # the gather's write
    tree_slots = torch.cat([torch.as_tensor(s) for s in c["node_slots"]]).to(q.device)
    kc, vc = k[tree_slots], v[tree_slots]                             # Medusa's unpaged cache: not timed
    mask = dense_tree_mask(paths, tree_slots.cpu()).to(q.device)
    fns["Medusa-style (dense mask)"] = lambda: medusa_tree_attention(q, kc, vc, mask)
    kv_read["Medusa-style (dense mask)"] = c["n_tok"] * tok_bytes
    # [h, n_q, n_kv] scores written, scaled, masked (+ the mask), softmax in fp32, cast: ~5 passes each way.
    partial["Medusa-style (dense mask)"] = h * n_q * c["n_tok"] * (2 * e + 2 * 4 + 2 * e) + mask.numel() * e
    rows = []
    for label, fn in fns.items():
        err = (fn()[ref_idx].float() - ref).abs().max().item()
        t = time_ms(fn, warmup=3, iters=iters)
        rows.append({"workload": name, "n_q": n_q, "tree_tokens": c["n_tok"], "method": label, "attn_us": t * 1e3,
                     "kv_read_MB": kv_read[label] / 1e6, "partials_MB": partial[label] / 1e6,
                     "floor_us": floor_s * 1e6, "x_floor": t * 1e-3 / floor_s, "max_err": err})
    best_base = min(r["attn_us"] for r in rows if not r["method"].startswith("DeFT"))
    for r in rows:
        r["speedup_vs_best_baseline"] = best_base / r["attn_us"]
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=["fewshot", "reasoning", "spec"],
                   choices=["fewshot", "reasoning", "spec"])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128, choices=deft.HEAD_DIMS)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--prompt", type=int, default=4000, help="few-shot prompt tokens")
    p.add_argument("--branches", type=int, nargs="+", default=[20, 30, 50])
    p.add_argument("--generated", type=int, default=200, help="tokens each few-shot branch has (mid-run of 400)")
    p.add_argument("--tot-prompt", type=int, default=2000)
    p.add_argument("--tot-depth", type=int, default=4)
    p.add_argument("--tot-width", type=int, default=10)
    p.add_argument("--tot-branch", type=int, default=3)
    p.add_argument("--thought", type=int, default=300)
    p.add_argument("--prefix", type=int, default=6000, help="speculative decoding: tokens before the token tree")
    p.add_argument("--tree-tokens", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="CPU smoke sizes (with TRITON_INTERPRET=1)")
    p.add_argument("--out", default="results/deft")
    a = p.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not deft.available(dev):
        raise SystemExit("DeFT needs triton and a GPU, or TRITON_INTERPRET=1 on CPU (a smoke run with --tiny)")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    if dev.type == "cpu":
        dtype = torch.float32                                         # the interpreter's bf16 tl.dot is broken
    if a.tiny:
        a.heads, a.kv_heads, a.head_dim, a.iters = 4, 2, 64, 2
        a.prompt, a.branches, a.generated, a.tree_tokens, a.prefix = 64, [3], 8, [8], 80
        a.tot_prompt, a.tot_depth, a.tot_width, a.tot_branch, a.thought = 40, 3, 2, 2, 6
    shapes = []
    if "fewshot" in a.workloads:
        shapes += [(f"fewshot b={b}", fewshot_shape(a.prompt, b, a.generated)) for b in a.branches]
    if "reasoning" in a.workloads:
        shapes.append((f"ToT-BFS d={a.tot_depth} w={a.tot_width} k={a.tot_branch}",
                       tot_shape(a.tot_prompt, a.tot_depth, a.tot_width, a.tot_branch, a.thought)))
    if "spec" in a.workloads:
        shapes += [(f"spec t={t}", spec_shape(a.prefix, t)) for t in a.tree_tokens]
    bw = copy_bandwidth(dev, (1 << 30) if dev.type == "cuda" else (1 << 24))
    rows = []
    e = torch.tensor([], dtype=dtype).element_size()
    for name, shape in shapes:
        why = not_fitting(case_bytes(shape, h=a.heads, h_kv=a.kv_heads, d=a.head_dim, e=e), dev)
        if why:
            rows.append({"workload": name, "method": "every method", "not_run": why})
            print(f"{name}: {why}", flush=True)
            continue
        c = make_case(shape, h=a.heads, h_kv=a.kv_heads, d=a.head_dim, dtype=dtype, device=dev)
        rows += run_case(name, c, iters=a.iters, bw=bw)
        print(f"{name}: done", flush=True)
        del c
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (Triton interpreter)"
    header = (f"DeFT tree attention, one decode step, one layer: h={a.heads}, h_kv={a.kv_heads}, d={a.head_dim}, "
              f"{dtype}, {gpu}; median of {a.iters}. Measured copy bandwidth {bw / 1e12:.3f} TB/s (read+write). "
              f"Bytes per token: 2*h_kv*d*e = {2 * a.kv_heads * a.head_dim * e} B. floor_us = tree tokens x that / "
              "copy bandwidth (every KV byte read once); x_floor = attn_us / floor_us. kv_read_MB: DeFT = sum over "
              "work items of their tokens (a range is read once per query tile; tiles of one range mostly hit L2); "
              "Q-guided = sum of path lengths; gather+SDPA = 2 x sum of paths (gather read + attention read); "
              "Medusa = tree tokens. partials_MB: DeFT = 2 x (query, item) pairs x h x (d+1) x 4 (fp32 (o, lse) "
              "written and read); gather+SDPA = the gathered copy written; Medusa = h*n_q*n_kv*(4e+8) + mask. "
              "max_err: against an fp32 reference on the first 16 queries.")
    print(write_report(rows, a.out, header))


if __name__ == "__main__":
    main()
