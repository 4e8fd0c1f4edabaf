"""The decode side of the cost model: one decode step of one layer, tree decoding's merge variants against ring
decoding (tree-attention.txt Sec. 6.3), eager or replayed as a CUDA graph.

Tree decoding moves one (o, lse) per query through all-reduces (a tree across nodes: 2 log2(nodes) inter-node
hops of latency) or one all-gather; ring decoding moves every KV shard round the ring. The local step streams the
KV shard from HBM (memory-bound). Decode is launch-bound: a fixed host cost per kernel (LAUNCH_S eagerly,
GRAPH_LAUNCH_S graphed) and the links' latencies (scaled by GRAPH_LATENCY_RATIO graphed) dominate at short
contexts. Not modelled: eager host overhead beyond that fixed cost per kernel (the 2 x H200 eager runs spend
0.3-0.9 ms per layer of Python and launches, with run-to-run noise of that size: docs/cost_model.md).
`inference/static.py` asks `choose_tree_variant` for the variant of its static step. `decode_step_time` adds the
rest of a graphed GPT decode step (the linears' weights, the small kernels and the graph's gaps) to the attention.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .hardware import MERGE_BYTES, Hardware, Link, check_int, overlapped, phase_link

DECODE_METHODS = ("tree-allreduce3", "tree-allreduce2", "tree-allgather", "ring-decode")
PEER_METHOD = "tree-peer"
"""tree_decode's "peer" variant (kernels/peer_merge.py): no collective, one kernel that signals the peers, reads
their partials over NVLink and merges. Only within one node, one GPU a rank, NCCL: not among DECODE_METHODS, which
run anywhere; `choose_tree_variant(..., peer=True)` and `predict_decode` take it."""
PEER_SIGNAL_S = 2.8e-6
"""One flag round of a peer kernel call in a graphed step (the remote atomics, seen by the peer, and the wait for
them). Measured as a difference: on 2 x H200 (2026-11-27, the 8B shape, 128k, CP = 2, split MLPs) the step took
4.86 ms with the peer merge and the peer sum in two rounds each and 4.68 ms in one (symmetric.fence: the done
round dropped), over 64 calls a step; at batch 8 and at 512k the same run gave 3.0 and 2.7 us. The two-round merge
had been credited ~0.6 us a round before, fitted on the step with the rest of the model's exchange
(docs/cost_model.md)."""
# Decode is launch-bound: its kernels take microseconds, and PyTorch's eager dispatch + CUDA launch costs ~5-10 us
# each. Kernels per call, counted in algos/tree_decode.py: the local split-KV step 2, the max / weights / divide
# of the all-reduce variants 14 (13 unpacked), allgather's fused merge of the gathered buffer 1 (the split-KV
# step writes its partial into that buffer), merge_ 13 (ring decoding: one per step).
LAUNCH_S = 8e-6
_DECODE_KERNELS = {"tree-allreduce3": 13, "tree-allreduce2": 14, "tree-allgather": 1, "local": 2, "merge": 13}
# A decode step replayed as one CUDA graph has no host dispatch: kernel nodes follow each other ~2 us apart, and
# an NCCL collective of a few kB costs ~20 us instead of the ~45 us of an eager call (2 x H200, bench.decode:
# allreduce3 - allreduce2 = 22 us per layer, allgather - local = 21 us per layer, both graphed).
GRAPH_LAUNCH_S = 2e-6
GRAPH_LATENCY_RATIO = 0.45


@dataclass(frozen=True)
class DecodeProblem:
    """One decode step of one layer: n_q new tokens over a KV cache of `context` tokens sharded over P ranks."""

    context: int
    """Tokens in the KV cache (all ranks together)."""
    world: int
    """P, ranks the cache is sharded over (equal shards, the largest counts)."""
    heads: int
    """h, query heads."""
    kv_heads: int | None = None
    """h_kv; None: h."""
    head_dim: int = 128
    """d."""
    batch: int = 1
    """b."""
    n_q: int = 1
    """New query tokens per sequence (1, or a few speculative ones)."""
    dtype_bytes: int = 2
    """e of the cache: 2, 4 or 8."""
    positions: bool = False
    """Ring decoding passes int64 kv_positions with every shard (ragged / padded caches)."""

    def __post_init__(self):
        for f in ("context", "world", "heads", "head_dim", "batch", "n_q"):
            check_int(f"DecodeProblem.{f}", getattr(self, f))
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        check_int("DecodeProblem.kv_heads", self.kv_heads)
        if self.heads % self.kv_heads:
            raise ValueError(f"DecodeProblem.heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads})")
        if self.dtype_bytes not in (2, 4, 8):
            raise ValueError(f"DecodeProblem.dtype_bytes must be 2, 4 or 8, got {self.dtype_bytes!r}")

    @property
    def shard(self) -> int:
        return -(-self.context // self.world)


def decode_bytes(method: str, pb: DecodeProblem) -> int:
    """Bytes one rank sends in one decode call of `method` (DECODE_METHODS or PEER_METHOD), with comm.py's
    convention (peer: the bytes the peers read of this rank's partial). tree_decode's validation all-gather
    (validate=True; generation passes False) is not included."""
    if method not in DECODE_METHODS + (PEER_METHOD,):
        raise ValueError(f"method must be one of {DECODE_METHODS}, got {method!r}")
    P, acc = pb.world, 8 if pb.dtype_bytes == 8 else 4
    o = pb.batch * pb.n_q * pb.heads * pb.head_dim * acc           # o / numerator, fp32
    r = pb.batch * pb.heads * pb.n_q * acc                         # lse / max / denominator, fp32
    ar = lambda n: 2 * (P - 1) * n // P  # noqa: E731               all-reduce
    if method == "tree-allreduce3":
        return ar(r) + ar(o) + ar(r)
    if method == "tree-allreduce2":
        return ar(r) + ar(o + r)
    if method in ("tree-allgather", PEER_METHOD):
        return (P - 1) * (o + r)
    return (P - 1) * _ring_decode_msg(pb)


def _ring_decode_msg(pb: DecodeProblem) -> int:
    kv = 2 * pb.batch * pb.shard * pb.kv_heads * pb.head_dim * pb.dtype_bytes
    return kv + (pb.batch * pb.shard * 8 if pb.positions else 0)


def predict_decode(method: str, pb: DecodeProblem, hw: Hardware, *, graphed: bool = False,
                   peer_rounds: int = 2) -> float:
    """Predicted seconds of one decode call (one layer) of `method` on `hw`. Host overhead: LAUNCH_S per kernel
    eagerly; graphed (the step replayed as a CUDA graph): GRAPH_LAUNCH_S per kernel and collective latencies
    scaled by GRAPH_LATENCY_RATIO; the peer kernel has no collective: PEER_SIGNAL_S per flag round, peer_rounds of
    them (2: ready and done; 1: fenced with the split MLPs' peer sum, symmetric.fence)."""
    if method not in DECODE_METHODS + (PEER_METHOD,):
        raise ValueError(f"method must be one of {DECODE_METHODS}, got {method!r}")
    P, acc = pb.world, 8 if pb.dtype_bytes == 8 else 4
    k = _DECODE_KERNELS
    launch = GRAPH_LAUNCH_S if graphed else LAUNCH_S

    def link(**kw) -> Link:
        lk = phase_link([list(range(P))], hw, **kw)
        return dataclasses.replace(lk, lat=lk.lat * GRAPH_LATENCY_RATIO) if graphed else lk

    # The local flash-decode step streams its K, V shard from HBM; its FLOPs (4 b n_q h s d) are negligible.
    local = 2 * pb.batch * pb.shard * pb.kv_heads * pb.head_dim * pb.dtype_bytes / hw.mem_bw + k["local"] * launch
    if P == 1:
        return local
    merge = pb.batch * pb.n_q * pb.heads * pb.head_dim * MERGE_BYTES / hw.mem_bw + k["merge"] * launch
    if method == "ring-decode":
        steps = [local] + [local + merge] * (P - 2)
        return overlapped(steps, [link(p2p=True).t(_ring_decode_msg(pb))] * (P - 1)) + local + merge
    o = pb.batch * pb.n_q * pb.heads * pb.head_dim * acc
    r = pb.batch * pb.heads * pb.n_q * acc
    if method == PEER_METHOD:
        # The flag rounds, the peers' partials read over NVLink (P - 1 reads at once), the merge's HBM traffic.
        return (local + peer_rounds * PEER_SIGNAL_S + (P - 1) * (o + r) / hw.intra_bw + launch
                + (P + 1) * (o + r) / hw.mem_bw)
    if method == "tree-allgather":
        # One all-gather of every rank's packed (o, lse); one kernel reads the P partials and writes the output.
        return local + link(p2p=False).t((P - 1) * (o + r)) + k[method] * launch + (P + 1) * (o + r) / hw.mem_bw
    ar = link(p2p=False, collective="allreduce")
    if method == "tree-allreduce3":
        return (local + ar.t(2 * (P - 1) * r / P) + ar.t(2 * (P - 1) * o / P) + ar.t(2 * (P - 1) * r / P)
                + k[method] * launch)
    return local + ar.t(2 * (P - 1) * r / P) + ar.t(2 * (P - 1) * (o + r) / P) + k[method] * launch


def choose_decode(pb: DecodeProblem, hw: Hardware, candidates=DECODE_METHODS, *,
                  graphed: bool = False) -> tuple[str, dict[str, float]]:
    """The fastest decode method by the model, and every candidate's predicted seconds."""
    times = {m: predict_decode(m, pb, hw, graphed=graphed) for m in candidates}
    if not times:
        raise ValueError("choose_decode: candidates is empty")
    return min(times, key=times.get), times


def choose_tree_variant(pb: DecodeProblem, hw: Hardware, *, graphed: bool,
                        peer: bool = False) -> tuple[str, dict[str, float]]:
    """tree_decode's merge variant ("allreduce3" | "allreduce2" | "allgather", and "peer" where `peer` says the
    group can map symmetric memory and P fits one node) the model predicts fastest for one layer, eager or
    graphed, and every candidate's predicted seconds (keyed by variant)."""
    peer = peer and pb.world <= hw.gpus_per_node
    best, times = choose_decode(pb, hw, DECODE_METHODS[:3] + ((PEER_METHOD,) if peer else ()), graphed=graphed)
    return best.split("-", 1)[1], {m.split("-", 1)[1]: t for m, t in times.items()}


# The whole graphed decode step (inference/static.py), fitted on one profile (2 x H100, 2026-11-26, the 8B shape:
# docs/decode.md, "Measured after these"; bench/decode_profile.py parts):
GEMV_EFFICIENCY = 0.88
"""The linears' weights stream at this fraction of the floor's bandwidth (10.21 GB in 3.86 ms at 3.01 TB/s; fc1
and fc2 0.9, QKV and the projection 0.77, kernels/gemv.py)."""
SMALL_KERNEL_S = 2.0e-6
"""Mean duration of the step's small kernels (norms, the q copy, RoPE + append, residual adds, the step's integer
ops: 436 us over 216 kernels a step)."""
GRAPH_GAP_S = 0.65e-6
"""Idle device time after each kernel of a replayed graph (243-286 us over 410 kernels a step)."""
PDL_GAP_S = 0.05e-6
"""The same with programmatic dependent launch (kernels/_launch.pdl): the step's Triton kernels start before the one
ahead ends, and the measured steps lost ~0.6 us a kernel (graphed, batch 1, the 8B shape, with against without in
one run: 1 H100 32k 5.67 / 5.88 ms; 1 H200 32k 4.40 / 4.61, 128k 7.25 / 7.46; 2 x H200 CP = 2 128k 5.85 / 6.07,
512k 11.49 / 11.71; 0.21-0.22 ms over 346-410 kernels). Not at batch 8 on one H200 (32k: 12.40 against 11.84 ms
without; 2 x H200 128k: 20.43 / 20.51): the model keeps one gap for every batch."""
SMALL_KERNELS_PER_LAYER = 3
"""Per layer besides the four linears and the attention: two norms and RoPE + append (the residual adds are inside
fc2's and the projection's kernels, the biases and GELU inside the linears', and since the fourteenth session the
query comes out of the QKV kernel in heads, hooks.GroupedQKV: megatron-core's q reshape copy is gone; the sets
measured before it have 4)."""
STEP_KERNELS = 14
"""Per step outside the layers: the embedding lookup, the position and length updates, the final norm, the output
layer, argmax, the token copies (12 small kernels, 1 GEMV, 1 reduction)."""


@dataclass(frozen=True)
class DecodeModel:
    """The shape of a GPT whose whole decode step decode_step_time predicts (local layer spec, one TP rank)."""

    layers: int
    """Transformer layers."""
    hidden: int
    """Hidden size."""
    heads: int
    """Query heads."""
    kv_heads: int
    """KV heads (query groups)."""
    ffn: int
    """MLP hidden size (not gated: fc1 [ffn, hidden])."""
    vocab: int
    """Vocabulary (the embedding and the untied output layer)."""
    head_dim: int = 128
    """d."""
    dtype_bytes: int = 2
    """e of the weights and the cache."""

    def weight_bytes(self) -> int:
        """Every parameter once, as inference/floor.weight_bytes counts them (linears with biases, two norms a
        layer, the final norm, the embedding and the output layer)."""
        h, d = self.hidden, self.head_dim
        qkv = (self.heads + 2 * self.kv_heads) * d
        layer = (qkv * h + qkv) + (h * self.heads * d + h) + (self.ffn * h + self.ffn) + (h * self.ffn + h) + 2 * h
        return (self.layers * layer + h + 2 * self.vocab * h) * self.dtype_bytes

    def mlp_bytes(self) -> int:
        """What the split MLPs divide over the ranks (inference/split_mlp.py): fc1's weight and bias, fc2's weight."""
        return self.layers * (2 * self.ffn * self.hidden + self.ffn) * self.dtype_bytes


PEER_SUM_S = 9.8e-6
"""One call of the split MLPs' NVLink reduce (kernels/peer_sum.py) in two flag rounds, graphed, the wait for the
other rank included: `megatron-cp-bench peer-sum` on 2 x H100 (2026-11-27), 9.75 us at 1 row and 9.9 at 8 rows of
4096 (NCCL's all-reduce + adds 18.1 / 18.9); 6.9 and 7.6 us on 2 x H200 (2026-11-27; all-reduce 18.1 / 19.6). The
H100 figure is kept: the step sets of both machines stay within their bars with it. One round (fenced): this less
PEER_SIGNAL_S."""


def split_reduce_time(m: DecodeModel, world: int, hw: Hardware, *, batch: int = 1, peer: bool = True,
                      peer_rounds: int = 2) -> float:
    """Seconds of one split MLP's reduce in a graphed step (every rank's fp32 b x hidden partial summed, fc2's bias
    and the residual added): the peer kernel (kernels/peer_sum.py: PEER_SUM_S, measured, in peer_rounds flag rounds,
    plus the peers' partials read over NVLink beyond the measured 16 kB) or the group's all-reduce and three small
    kernels."""
    part = batch * m.hidden * 4
    if world == 1:
        return 0.0
    if peer:
        return PEER_SUM_S - (2 - peer_rounds) * PEER_SIGNAL_S + (world - 1) * max(0, part - 4096 * 4) / hw.intra_bw
    lk = phase_link([list(range(world))], hw, p2p=False, collective="allreduce")
    lk = dataclasses.replace(lk, lat=lk.lat * GRAPH_LATENCY_RATIO)
    return lk.t(2 * (world - 1) * part / world) + 4 * GRAPH_LAUNCH_S + 3 * part / hw.mem_bw


def decode_step_time(m: DecodeModel, context: int, world: int, hw: Hardware, *, batch: int = 1,
                     mem_bw: float | None = None, small_per_layer: int = SMALL_KERNELS_PER_LAYER,
                     pdl: bool = True, method: str = "tree-allgather", mlp: str = "whole",
                     peer_rounds: int = 2) -> dict[str, float]:
    """Predicted seconds of one graphed decode step of model `m` (batch 1-8, tree decoding, the allgather merge at
    P > 1) and its parts: gemm (every weight once at GEMV_EFFICIENCY), attention and exchange (predict_decode per
    layer, graphed), small (SMALL_KERNEL_S each), gaps (GRAPH_GAP_S after every kernel), total; and floor, the
    bandwidth floor (weights + this rank's KV shard) / mem_bw. mem_bw: the bandwidth measured in a run (default
    hw.mem_bw); small_per_layer: the layers' small kernels (6 before the residual adds went into the linears);
    pdl: the kernels launch with programmatic dependent launch (PDL_GAP_S after each instead of GRAPH_GAP_S);
    method: the merge at P > 1, "tree-allgather" (an NCCL all-gather and a merge kernel a layer) or PEER_METHOD
    (one kernel a layer); mlp "split" (P > 1): each rank reads 1/P of the MLPs and pays a reduce a layer
    (split_reduce_time: the peer kernel with PEER_METHOD, else the all-reduce), "whole": every rank all of them;
    peer_rounds: flag rounds of each peer kernel call, 1 where the peer merge and the peer sum alternate (split MLPs
    with PEER_METHOD: symmetric.fence, the static decoder's default there), else 2."""
    if peer_rounds not in (1, 2) or (peer_rounds == 1 and not (method == PEER_METHOD and mlp == "split")):
        raise ValueError(f"peer_rounds must be 2, or 1 with method {PEER_METHOD!r} and mlp 'split', got "
                         f"{peer_rounds!r}")
    if method not in ("tree-allgather", PEER_METHOD):
        raise ValueError(f"method must be 'tree-allgather' or {PEER_METHOD!r}, got {method!r}")
    if mlp not in ("whole", "split"):
        raise ValueError(f"mlp must be 'whole' or 'split', got {mlp!r}")
    bw = hw.mem_bw if mem_bw is None else mem_bw
    if not bw > 0:
        raise ValueError(f"mem_bw must be positive, got {mem_bw!r}")
    hwb = dataclasses.replace(hw, mem_bw=bw)
    pb = DecodeProblem(context, world, m.heads, m.kv_heads, m.head_dim, batch=batch, dtype_bytes=m.dtype_bytes)
    local = predict_decode("tree-allgather", dataclasses.replace(pb, world=1, context=pb.shard), hwb, graphed=True)
    attn = predict_decode(method, pb, hwb, graphed=True, peer_rounds=peer_rounds if world > 1 else 2)
    split = mlp == "split" and world > 1
    weights = m.weight_bytes() - (m.mlp_bytes() * (world - 1) // world if split else 0)
    peer = method == PEER_METHOD
    kernels = m.layers * (4 + small_per_layer + _DECODE_KERNELS["local"] + (0 if world == 1 else 1 if peer else 2)
                          + (0 if not split else 1 if peer else 4)) + STEP_KERNELS
    parts = {"gemm": weights / (bw * GEMV_EFFICIENCY), "attention": m.layers * local,
             "exchange": m.layers * (attn - local + (split_reduce_time(m, world, hwb, batch=batch, peer=peer,
                                                                       peer_rounds=peer_rounds)
                                                     if split else 0.0)),
             "small": (m.layers * small_per_layer + STEP_KERNELS - 2) * SMALL_KERNEL_S,
             "gaps": kernels * (PDL_GAP_S if pdl else GRAPH_GAP_S)}
    parts["total"] = sum(parts.values())
    kv = 2 * m.layers * batch * pb.shard * m.kv_heads * m.head_dim * m.dtype_bytes
    parts["floor"] = (weights + kv) / bw
    return parts
