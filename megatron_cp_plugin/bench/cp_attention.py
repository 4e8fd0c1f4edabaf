"""Every algorithm side by side with single-GPU attention on the full sequence and the external anchors
(PyTorch's native context parallel, TransformerEngine's, ring-flash-attn: bench/anchors.py), in one run.

    megatron-cp-bench attention --seq 32768 131072 [--slow-link]      (under torchrun --nproc-per-node P)
    torchrun --nproc-per-node 2 -m megatron_cp_plugin.bench.cp_attention --seq 131072

Every rank times the same call with CUDA events (median of --iters after --warmup), the slowest rank
counting; the single-GPU baseline runs on rank 0 alone over the full sequence with the default local kernel
(cuDNN on Hopper). Reported: ms, TFLOP/s per GPU (FLOP formula printed), the ratio to the single-GPU time
(scaling efficiency = 1 / (P * ratio)), the ratio to the fastest PyTorch native CP configuration and to
`ring-te` (fwd_bwd_x_ring_te: our ring with TransformerEngine's p2p byte budget, dK, dV in the input dtype; the
baseline of issue 16's targets), peak memory, and bytes sent per fwd+bwd (our algorithms count them; anchors do
not expose theirs). TransformerEngine's own p2p ring (`te-p2p`) runs as an anchor where `import
transformer_engine` works; elsewhere the report says why and rank 0 prints one line.

Memory: before anything of a configuration is allocated, every rank checks its need (`attention_need`, from the
shapes alone) against what its device has free (`_common.not_fitting`, all ranks together); one that does not fit
is a row with `not_run` ("not run: needs X GiB of Y GiB free on <device>", printed once by rank 0), never an
out-of-memory traceback, and the run goes on with the next one.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import megatron_cp_plugin as mcp
from megatron_cp_plugin.algos import registry
from megatron_cp_plugin import cp_grid
from megatron_cp_plugin.algos.allgather import GROUPED_MIN_P
from megatron_cp_plugin.algos.ring import round_size
from megatron_cp_plugin.cp_grid import group_chunks
from megatron_cp_plugin.bench.anchors import Unavailable, builders
from megatron_cp_plugin.bench._common import (FLOP_FORMULA, GiB, attention_flop, gather_max, init_distributed,
                                              not_fitting, time_ms, write_report)
from megatron_cp_plugin.kernels.local_attn import block_bwd, block_fwd, select_backend


# ----------------------------------------------------------------------------------------------- memory
MARGIN = 1.15
"""attention_need's factor over the tensors it counts. Without it the count was 0.95-1.36x the measured peak
(torch.cuda.max_memory_allocated) of every algorithm on an H200 at S = 128k, h = 32, MHA and GQA 32/8: P = 2, 4, 8
in rank_replay, grids 2x1 to 8x1, and P = 2 in this bench over NCCL (single device 1.00x, P = 2 rings the most
over); the factor covers the under-count and the caching allocator's fragmentation (reserved beyond allocated:
blocks rounded up to 2 MiB granules, a freed block serving only requests that fit)."""

ANCHOR_AS = {"te-p2p": "ring", "ring-flash-attn": "ring"}
"""External anchors whose buffers are counted as those of our algorithm of the same schedule (zigzag p2p rings);
torch-cp-* count as allgather plus their full-sequence transposed copies (anchors.torch_cp)."""


def input_bytes(S: int, *, h: int, hk: int, d: int, elem: int, b: int = 1) -> int:
    """The full-sequence q, k, v, dO [b, S, h | hk, d] every rank of the attention and packed benches holds."""
    return b * S * (2 * h + 2 * hk) * d * elem


def attention_need(algo: str, S: int, P: int, *, h: int, hk: int, d: int, elem: int, b: int = 1, grid=None,
                   packed: bool = False, shards: bool = True, grouped: bool = True,
                   group_tokens: int | None = None) -> float:
    """Bytes one rank newly allocates for one fwd+bwd of `algo` over P ranks on S tokens, beyond the full inputs
    (input_bytes); algo "single": one device on the whole sequence (P = 1), the reference row. The code's own
    buffers at the peak of the forward (F) or of the backward (B, with the saved o, lse), times MARGIN:

      per rank   s = S / P, Q = b s h d e, K = b s h_kv d e, L = b h s a (fp32 lse / D rows); Qa, Ka: Q, K's
                 elements at a = 4 bytes (the fp32 accumulators); e = elem
      every algo the shards q, k, v, dO (2Q + 2K; shards=False: already held, as in rank_replay), the saved o, lse
                 (Q + L), the returned dq, dk, dv (G = Q + 2K); around each backward kernel call the last call's
                 dq, dk, dv (still named), its own, a causal_strict block's zeros (Attention2D) and the kernel's
                 workspace ws: cuDNN's / FA2's fp32 dQ accumulator (Qa) and with GQA dK, dV expanded to every q
                 head (2Q; the single-device rows measured exactly Q + L + G + ws)
      ring       K, V in hand and in flight (4K, forward and backward), fp32 o, merge cast (2Qa), dq (Qa), dK, dV:
                 own, in hand, arriving (6Ka); ring-te the same or less. In rounds of g ranks (ring.round_size):
                 4gK in hand and in flight, fp32 dq, dk, dv (Qa + 2Ka), partials (6gK), a call's gradients
                 over g ranks' keys twice (2(Q + 2gK)) and ws, and at b > 1 the copied chunks and keys
      burst      ring's forward; (Q, dO, D, lse) in hand and in flight (4Q + 5L; P = 2: 2Q), dQ own, in hand,
                 arriving (3Qa), dK, dV (2Ka), the surrogate O (Q, built through 3Qa of fp32 temporaries)
      allgather  gathered K, V (2PK), fp32 partials of every owner (2PKa), reduce_at_owner's cast, packed bytes
                 and output (6PK, bounded by 8PK: measured 7% above the count) or its fp32 sum (2PK + 2PKa + 2Ka);
                 from P = GROUPED_MIN_P (unpacked) its grouped calls: no stack, keys over up to (P - 1) / 2 shards
                 (their copies (P - 1)K at b > 1) and those calls' gradients
      ulysses    head-sharded q, k, v (Q + 2Kh, Kh = b U s k_U d e, k_U the most K, V heads a member reads), each
                 all-to-all's packing, output, reshape and reorder copies (4x what it moves); ulysses-ring adds
                 ring's terms on the head shards across its R groups
      attention2d-no  R x C grid: K, V row-major (2K), Q gathered in the row (CQ, none at C = 1), K, V in the
                 column (2RK, none at R = 1), fp32 partials (C (Qa + L)), a kernel call over n chunks
                 (cp_grid.group_chunks) and AttnFix's all-to-all (2 C (Qa + L)); backward Q, dO, D, lse (2CQ + 2CL),
                 K, V, dq and dK, dV partials (C Qa + 2R Ka), then a call over n chunks, the dq reduction (2C Qa)
                 or the dK, dV one (4RK, or 2RK + 2Ka)
      attention2d-o   the column's K, V chunks (2RK), Q in flight, fp32 o accumulators own, in hand, arriving,
                 sent (Qa + L each, C = 1: one), Q, dO, D, lse in hand and in flight, dQ accumulators (C = 1:
                 Qa, 2: 3Qa, else 4Qa), dK, dV partials (2R Ka) and the travelling one (R = 2: 4K, else 4Ka);
                 its batched passes' stack (2RK) and calls (m (2Q + L) forward, m (4Q + 2K + L) + Qa backward)
      torch-cp-* allgather's (one call per owner: grouped=False) plus its transposed copies of the full q, k, v,
                 dO (2P (Q + K)) and 2P Ka more
      single     o, lse, dq, dk, dv and ws over the whole sequence
      packed     + the reordered q, k, v and o copies and their gradients (4Q + 4K)

    grid: (R, C) of a grid algorithm (default: the registry's for P and the heads); grouped=False: allgather as
    one call per owner (what the torch-cp anchors do); group_tokens: Attention2D's cap (CPGrid.group_tokens)."""
    algo = ANCHOR_AS.get(algo, algo)
    e, a = elem, 8 if elem == 8 else 4
    s = S // P
    if algo.startswith("torch-cp-"):       # its transposed q, k, v, dO copies; + 2P Ka: allgather's count alone came
        copies = 2 * P * b * s * (h + hk) * d * e + 2 * P * b * s * hk * d * a   # 7-11% under its measured peak
        return attention_need("allgather", S, P, h=h, hk=hk, d=d, elem=elem, b=b, grouped=False) + MARGIN * copies
    Q, K, L = b * s * h * d * e, b * s * hk * d * e, b * h * s * a
    Qa, Ka = Q // e * a, K // e * a
    ws = Q // e * 4 + (2 * Q if hk < h else 0)                 # one backward call over all of the rank's rows
    G = Q + 2 * K
    blk = 2 * G + ws                                           # the last call's grads, this one's, ws
    saved = Q + L
    if algo == "single":
        return MARGIN * (saved + G + ws)
    base = (2 * Q + 2 * K if shards else 0) + (4 * Q + 4 * K if packed else 0)
    g = round_size(P, s, packing=True if packed else None)
    copies = 2 * K + 2 * g * K if g > 1 and b > 1 else 0      # rounds at b > 1: the chunks sent, a call's keys
    ring_f = (2 * Qa + 4 * g * K + 2 * Q if g > 1 else 2 * Qa + 4 * K + 2 * Q) + copies
    if algo in ("ring", "ring-te"):
        F = ring_f
        B = (4 * g * K + Qa + 2 * Ka + 6 * g * K + 2 * (Q + 2 * g * K) + ws + copies if g > 1
             else Qa + 4 * K + 6 * Ka + blk)
    elif algo == "burst" and g > 1:        # rounds: as memory_terms.burst, and at b > 1 the chunk and run copies
        F = ring_f
        call = g * Q + 2 * g * L + 2 * (g * Q + 2 * K) + g * ws
        B = (3 * L + 4 * g * (Q + L) + Qa + 2 * Ka + 3 * g * Q + call + G
             + (2 * Q + 2 * g * Q if b > 1 else 0))
    elif algo == "burst":
        F = ring_f
        B = (4 * Q + 4 * L if P > 2 else 2 * Q + 2 * L) + L + 3 * Qa + 2 * Ka + Q + max(3 * Qa, blk) + G
    elif algo == "allgather":
        reduce = max(8 * P * K, 2 * P * K + 2 * P * Ka + 2 * Ka)
        if grouped and P >= GROUPED_MIN_P and not packed:
            # grouped calls over up to (P - 1) / 2 shards of keys: their copies at b > 1 (views at b = 1), and
            # around a backward call the last call's and this one's gradients
            keys = (P - 1) * K if b > 1 else 0
            F = 2 * P * K + 2 * Qa + 2 * Q + keys
            B = 2 * P * K + 2 * P * Ka + Qa + max(2 * (Q + (P - 1) * K) + ws + keys, reduce, 2 * Ka + G)
        else:
            F = 2 * K + 2 * P * K + 2 * Qa + 2 * Q
            B = 2 * P * K + 2 * P * Ka + Qa + max(blk, reduce, 2 * Ka + G)
    elif algo in ("ulysses", "ulysses-ring"):
        R, U = (1, P) if algo == "ulysses" else (grid or registry.get(algo).grid_shape(P, h, hk))
        hu, grp = max(h // U, 1), max(h // hk, 1)           # the most K, V heads a member reads (ulysses.kv_spans)
        k_u = max(((u + 1) * hu - 1) // grp + 1 - u * hu // grp for u in range(U))
        Kh = b * U * s * k_u * d * e
        Kha, heads = Kh // e * a, Q + 2 * Kh
        ring_f = 2 * Qa + 4 * Kh + 2 * Q if R > 1 else Q
        ring_b = Qa + 4 * Kh + 6 * Kha + heads if R > 1 else 0
        F = heads + max(4 * heads, ring_f, 6 * Q)
        saved = heads + Q + L
        B = max(5 * Q, Q + heads + ws + ring_b, 6 * heads + 2 * Ka)
    elif algo == "attention2d-no":
        R, C = grid or registry.get(algo).grid_shape(P, h, hk)
        n = group_chunks(R, C, b * s, group_tokens)             # chunks per kernel call (column-major placement)
        gq, gkv = (C * Q if C > 1 else 0), (2 * R * K if R > 1 else 0)  # a group of one gathers nothing
        saved = 2 * K + Q + L
        # (one more copy of a gathered tensor: rank_replay's all-gather echo while preparing, and with n > 1 the
        # interleaved groups beside it: max(gq, gkv))
        F = max(2 * K + gq + gkv + C * (Qa + L) + max(n * (2 * Q + Qa), 2 * C * (Qa + L) if C > 1 else 0) + Q,
                2 * K + gq + gkv + max(gq, gkv))
        B = (L + 2 * gq + 2 * C * L + gkv + C * Qa + 2 * R * Ka
             + max(n * (Q + max(3 * Qa, blk + G)),                                      # the kernel calls
                   2 * C * Qa + Qa if C > 1 else 0,                                     # dq summed in the row
                   (Qa if C > 1 else 0) + max(4 * R * K, 2 * R * K + 2 * Ka) if R > 1 else 0,
                   Qa + 2 * Ka + 4 * K + G))                                            # the results
    elif algo == "attention2d-o":
        R, C = grid or registry.get(algo).grid_shape(P, h, hk)
        qn = 0 if C == 1 else 1 if C == 2 else 2                # Q blocks in flight (and in hand, C > 2)
        no = 1 if C == 1 else 3 if C == 2 else 4                # o accumulators: own, in hand, arriving, sent
        nq = 1 if C == 1 else 3 if C == 2 else 4                # dQ accumulators the same
        travel = 0 if R == 1 else 4 * K if R == 2 else 4 * Ka   # dK, dV arriving and sent (R = 2: in the input dtype)
        # batched passes (attention2d_o.batch_cap chunks a call, > 1 only for small chunks): the stacked column,
        # a call's repeated Q block, output and lse, and backward its repeated Q, dO, O, lse and gradients
        m = cp_grid.batch_chunks(R, b * s, group_tokens) if R > 1 and C > 1 else 1
        stack = 2 * R * K if m > 1 else 0
        batched = stack + m * (4 * Q + 2 * K + L) + Qa if m > 1 and C > 2 else 0
        saved = 2 * K + Q + L
        F = 2 * R * K + qn * Q + no * (Qa + L) + Q + max(Q + Qa, stack + m * (2 * Q + L))
        B = (qn * (2 * Q + 2 * L) + L + 2 * (R - 1) * K + 2 * R * Ka + nq * Qa + travel
             + max(Q + max(3 * Qa, blk + G), 2 * Ka + 4 * K + Q, batched))
    else:
        raise ValueError(f"attention_need: no memory model for {algo!r}")
    return MARGIN * (base + max(F, saved + B))


def _skip(rows, row, line, rank, what):
    """A not-run row for `what` (rank 0 keeps it and prints the line once)."""
    if rank == 0:
        rows.append({**row, "not_run": line})
        print(f"cp_attention: {what}: {line}", file=sys.stderr)


def _single(q, k, v, do, causal):
    mask = "causal" if causal else "none"
    fwd = lambda: block_fwd(q, k, v, mask=mask)  # noqa: E731
    return fwd, lambda: block_bwd(do, q, k, v, *fwd(), mask=mask)


def _cp(algo, q, k, v, do, causal, group):
    ql, kl, vl = (mcp.shard_sequence(t, algo=algo, group=group).requires_grad_() for t in (q, k, v))
    dol = mcp.shard_sequence(do, algo=algo, group=group)
    stats = mcp.CommStats()

    def fwd():
        with torch.no_grad():
            return mcp.context_parallel_attention(ql, kl, vl, algo=algo, group=group, causal=causal)

    def fwd_bwd():
        o = mcp.context_parallel_attention(ql, kl, vl, algo=algo, group=group, causal=causal, comm_stats=stats)
        torch.autograd.grad(o, (ql, kl, vl), dol)

    try:
        fwd_bwd()
    except ValueError as e:             # heads an all-to-all cannot split (ulysses): every rank raises it alike
        if not str(e).startswith("heads:"):
            raise
        raise Unavailable(str(e)) from None
    return fwd, fwd_bwd, stats


def _add_ratio(rows, column, is_ref):
    """Add `column`: each row's fwd+bwd time over the fastest row of its S for which is_ref(algo) holds (nan
    where none of that S ran). Rows that did not run get no entry."""
    for r in rows:
        best = [x["fwd_bwd_ms"] for x in rows if x["S"] == r["S"] and is_ref(x["algo"]) and "fwd_bwd_ms" in x]
        if "fwd_bwd_ms" in r:
            r[column] = r["fwd_bwd_ms"] / min(best) if best else float("nan")


def _ratios(rows):
    """fwd_bwd_x_torch_cp (over the fastest PyTorch native CP configuration) and, next to it,
    fwd_bwd_x_ring_te (over ring-te, the ring with TransformerEngine's byte budget)."""
    _add_ratio(rows, "fwd_bwd_x_torch_cp", lambda a: a.startswith("torch-cp-"))
    _add_ratio(rows, "fwd_bwd_x_ring_te", lambda a: a == "ring-te")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--algos", nargs="+", default=list(registry.names(baselines=True)),
                   help="our algorithms and baselines to run (default: all, ring-te included)")
    p.add_argument("--anchors", nargs="*", default=None, help="external anchors to run (default: all of "
                   "bench/anchors.py; none with an empty list)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default="results/cp_attention")
    p.add_argument("--slow-link", action="store_true",
                   help="NCCL over sockets (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1): PCIe/Ethernet-class links")
    return p


def main(argv=None):
    a = parser().parse_args(argv)
    if a.slow_link:
        os.environ.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1")
    rank, world, dev = init_distributed()
    bench(a, rank, world, dev)
    dist.destroy_process_group()


def bench(a, rank, world, dev):
    """The benchmark proper, on an initialised process group (`main` sets it up and tears it down)."""
    group, causal, hk = dist.group.WORLD, not a.no_causal, a.kv_heads or a.heads
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    shape = dict(h=a.heads, hk=hk, d=a.head_dim, elem=dtype.itemsize, b=a.batch)
    rows = []
    for s in a.seq:
        why = not_fitting(input_bytes(s, **shape), dev)             # the full q, k, v, dO every rank holds
        if why:
            _skip(rows, {"S": s, "algo": "inputs (full q, k, v, dO)", "P": world}, why, rank, f"S={s}")
            continue
        g = torch.Generator(device=dev).manual_seed(s)
        q, k, v, do = (torch.randn(a.batch, s, n, a.head_dim, device=dev, dtype=dtype, generator=g)
                       for n in (a.heads, hk, hk, a.heads))
        f1 = attention_flop(a.batch, s, a.heads, a.head_dim, causal, False)
        f2 = attention_flop(a.batch, s, a.heads, a.head_dim, causal, True)
        base = {}
        single = f"single-GPU {select_backend(dev, dtype, a.head_dim)}"
        # rank 0 alone runs it, every rank takes part in the check (an all-gather): the need is rank 0's
        why = not_fitting(attention_need("single", s, 1, **shape) if rank == 0 else 0, dev)
        if why:
            _skip(rows, {"S": s, "algo": single, "P": 1}, why, rank, f"S={s} {single}")
        elif rank == 0:
            fwd, fwd_bwd = _single(q, k, v, do, causal)
            base = {"fwd": time_ms(fwd, warmup=a.warmup, iters=a.iters),
                    "fwd_bwd": time_ms(fwd_bwd, warmup=a.warmup, iters=a.iters)}
            rows.append({"S": s, "algo": single, "P": 1,
                         "fwd_ms": base["fwd"], "fwd_bwd_ms": base["fwd_bwd"],
                         "fwd_TFLOPs/GPU": f1 / base["fwd"] / 1e9, "fwd_bwd_TFLOPs/GPU": f2 / base["fwd_bwd"] / 1e9,
                         "fwd_x_single": 1.0, "fwd_bwd_x_single": 1.0, "MB_sent_fwd_bwd": 0.0})
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
                fwd_bwd()
            base["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0
            rows[-1]["peak_GiB"] = base["peak_GiB"]
            del fwd, fwd_bwd
        dist.barrier()
        anchors = builders(causal)
        names = list(a.algos) + [n for n in anchors if a.anchors is None or n in a.anchors]
        for name in names:
            if dev.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            why = not_fitting(attention_need(name, s, world, **shape), dev)
            if why:
                _skip(rows, {"S": s, "algo": name, "P": world}, why, rank, f"S={s} {name}")
                continue
            stats, closer = None, None
            try:
                if name in anchors:
                    fwd, fwd_bwd, closer = anchors[name](q, k, v, do)
                else:
                    fwd, fwd_bwd, stats = _cp(name, q, k, v, do, causal, group)
            except Unavailable as e:
                if rank == 0:
                    rows.append({"S": s, "algo": f"{name} (not run: {e})", "P": world})
                    if name == "te-p2p" and s == a.seq[0]:    # the anchor issue 16 asks for: say so once
                        print(f"cp_attention: te-p2p anchor not run: {e}", file=sys.stderr)
                continue
            t1 = gather_max(time_ms(fwd, warmup=a.warmup, iters=a.iters))
            t2 = gather_max(time_ms(fwd_bwd, warmup=a.warmup, iters=a.iters))
            peak = gather_max(torch.cuda.max_memory_allocated() / GiB if dev.type == "cuda" else 0.0)
            if closer is not None:
                closer.close()
            del fwd, fwd_bwd                  # the shards and buffers go before the next row checks what is free
            if rank == 0:
                calls = a.warmup + a.iters + 1
                sent = (stats.forward_bytes + stats.backward_bytes) / calls / 2**20 if stats else float("nan")
                nan = float("nan")            # no single-GPU row to compare with (it did not fit)
                rows.append({"S": s, "algo": name, "P": world, "fwd_ms": t1, "fwd_bwd_ms": t2,
                             "fwd_TFLOPs/GPU": f1 / world / t1 / 1e9, "fwd_bwd_TFLOPs/GPU": f2 / world / t2 / 1e9,
                             "fwd_x_single": t1 / base["fwd"] if base else nan,
                             "fwd_bwd_x_single": t2 / base["fwd_bwd"] if base else nan,
                             "MB_sent_fwd_bwd": sent, "peak_GiB": peak})
        del q, k, v, do
        torch.cuda.empty_cache() if dev.type == "cuda" else None
    if rank == 0:
        _ratios(rows)
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
        link = " over sockets (--slow-link)" if a.slow_link else ""
        header = (f"cp_attention: b={a.batch} h={a.heads} h_kv={hk} d={a.head_dim} causal={causal} {dtype} on "
                  f"{world} x {name}{link}. {FLOP_FORMULA}. Median of {a.iters} after {a.warmup} warm-up.")
        print(write_report(rows, a.out, header, plot={"kind": "attention"}))     # bench/plots.py
    return rows


if __name__ == "__main__":
    main()
