"""Analytical cost model of every algorithm: FLOPs and bytes per rank, and a predicted time.

    python -m megatron_cp_plugin.cost_model --table measured|papers|node8|decode   (docs/cost_model.md)

Per rank and call, for a problem (N tokens over P ranks, b, h, h_kv, d, element size e) on some hardware:
  compute  causal-aware attention FLOPs: forward 4 b h N^2 d / P (x 1/2 causal; zigzag and cyclic layouts
           balance the causal work), backward 2.5 x forward (recompute QK^T + 4 matmuls), at the kernel's
           measured TFLOP/s; plus the memory-bound (o, lse) merges and gradient-accumulator adds.
  bytes    exactly what the algorithms' CommStats counters count (tests/test_cost_model.py checks every
           algorithm on gloo): burst-attention.txt Table 1 (ring: K, V forward; K, V, dK, dV backward; burst:
           Q, dQ, dO, D, lse backward) and attention2d.txt Sec. 3.3 (permutation, row / column gathers and
           reduce-scatters), with the ring-collective convention of comm.py (all-gather / reduce-scatter over g
           ranks: g - 1 chunks; all-reduce: 2 (g - 1) / g of the buffer).
  time     per step max(compute, communication + latency) where the algorithm overlaps them (ring, burst,
           attention2d-o), their sum where it does not (attention2d-no's collectives). A phase's link is the
           slowest one its ring or collective crosses: intra-node, or inter-node when its members span nodes
           (ring and burst once P > GPUs per node; Attention2D's node-aware row-major placement keeps grid
           rows inside a node, so row traffic is intra-node and column traffic inter-node). Inter-node flows
           that leave one node at the same time share its NICs.
Decode (tree-attention.txt Sec. 6.3): tree decoding moves one (o, lse) per query through all-reduces (a
tree across nodes: 2 log2(nodes) inter-node hops of latency); ring decoding moves every KV shard round the
ring. The local step streams the KV shard from HBM (memory-bound).

Not modelled: host overhead beyond a fixed cost per kernel launch in decode (the 2 x H200 decode runs show
0.3-0.9 ms per call of run-to-run noise, docs/results/decode*.md), kernel efficiency falling on small blocks,
contention between the compute and NCCL's copy kernels, NCCL protocol switches.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass

from .algos import ALGORITHMS
from .comm import attention2d_bytes, choose_grid, grid_rank, kv_moves

DECODE_METHODS = ("tree-allreduce3", "tree-allreduce2", "tree-allgather", "ring-decode")

# Memory-bound steps, in bytes of HBM traffic per element at `Hardware.mem_bw`. merge_ (kernels/merge.py) is six
# unfused elementwise kernels: measured 0.532 ms for 33.5M elements and 1.73 ms for 134M on H200
# (docs/results/local_attn.md), i.e. 54-67 bytes per element at the measured 4.2 TB/s copy bandwidth.
MERGE_BYTES = 60
# A gradient-accumulator add (fp32 += block result): read 4 + 4, write 4.
ADD_BYTES = 12
# AttnFix (Attention2D-NO): exp of lse, o * w, the packed copy and the final divide, ~3 elementwise passes.
ATTNFIX_BYTES = 30
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
class Hardware:
    """A cluster as the model sees it. Bandwidths are NCCL bus bandwidths (bytes a rank sends per second)."""

    intra_bw: float
    """Bytes/s per GPU for collectives between GPUs of one node (NVLink, PCIe)."""
    inter_bw: float
    """Bytes/s of one NIC between nodes (InfiniBand, Ethernet)."""
    intra_lat: float
    """Seconds per message or collective call inside a node, launch overhead included."""
    inter_lat: float
    """Extra seconds per inter-node hop (a p2p message across nodes, a step of a cross-node collective)."""
    gpus_per_node: int
    """GPUs (CP ranks) per node; CP group ranks fill nodes in order."""
    fwd_tflops: float
    """Attention kernel forward rate, FLOP/s (causal, long sequences)."""
    bwd_tflops: float
    """Attention kernel backward rate, FLOP/s (backward FLOPs = 2.5 x forward)."""
    mem_bw: float = 4.2e12
    """HBM bytes/s of a streaming kernel: the decode step's KV read, merges and accumulator adds."""
    nics_per_node: int | None = None
    """NICs per node; None: one per GPU. Inter-node flows leaving a node at once share them."""
    p2p_ratio: float = 1.0
    """Point-to-point bandwidth (ring sends) over collective bandwidth on the same link."""
    name: str = ""
    """Preset name, for reports."""

    def __post_init__(self):
        for f in ("intra_bw", "inter_bw", "fwd_tflops", "bwd_tflops", "mem_bw", "p2p_ratio"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ValueError(f"Hardware.{f} must be a positive finite number, got {v!r}")
        for f in ("intra_lat", "inter_lat"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"Hardware.{f} must be a non-negative number of seconds, got {v!r}")
        if not (isinstance(self.gpus_per_node, int) and self.gpus_per_node >= 1):
            raise ValueError(f"Hardware.gpus_per_node must be a positive integer, got {self.gpus_per_node!r}")
        if self.nics_per_node is not None and not (isinstance(self.nics_per_node, int) and self.nics_per_node >= 1):
            raise ValueError(f"Hardware.nics_per_node must be a positive integer or None, got {self.nics_per_node!r}")

    @property
    def nics(self) -> int:
        return self.nics_per_node or self.gpus_per_node


_CUDNN_FWD = 600e12    # cuDNN causal fwd on H200, 603-616 TFLOP/s at 16k-64k (DESIGN.md; 562 at 128k)
_CUDNN_BWD = 566e12    # backward alone, from fwd+bwd 575 TFLOP/s: 2.5 / (3.5 / 575 - 1 / 600)
_NVLINK = 329e9        # 2 x H200 NV18: NCCL all-reduce bus bandwidth at 1 GiB
_NVLINK_P2P = 360 / 329    # p2p measured 360 GB/s on the same pair
_NVLINK_LAT = 45e-6    # 1 MiB all-reduce 47 us, 3 us of it bandwidth (a 16 kB all-reduce measured 60-70 us)
_NDR = 45e9            # InfiniBand NDR 400 Gb/s per GPU (tree-attention.txt Sec. 6), ~90% of 50 GB/s usable

HARDWARE: dict[str, Hardware] = {
    # Our machine: 2 of the 8 H200 of an HGX node; inter-node numbers assumed (ConnectX-7 NDR per GPU).
    "h200-nvlink": Hardware(intra_bw=_NVLINK, inter_bw=_NDR, intra_lat=_NVLINK_LAT, inter_lat=10e-6, gpus_per_node=8,
                            fwd_tflops=_CUDNN_FWD, bwd_tflops=_CUDNN_BWD, mem_bw=4.2e12, p2p_ratio=_NVLINK_P2P,
                            name="h200-nvlink"),
    # The same pair with NCCL over sockets (--slow-link), fitted to docs/results/cp_attention_slowlink.md: the
    # collectives' traffic moved at 3.7-4.1 GB/s, ring p2p at 2.0-2.4 GB/s (NCCL gives p2p fewer sockets).
    "h200-sockets": Hardware(intra_bw=3.7e9, inter_bw=3.7e9, intra_lat=100e-6, inter_lat=100e-6, gpus_per_node=8,
                             fwd_tflops=_CUDNN_FWD, bwd_tflops=_CUDNN_BWD, mem_bw=4.2e12, p2p_ratio=0.64,
                             name="h200-sockets"),
    # attention2d.txt Sec. 4.1: 4 A100 per node over PCIe, Ethernet between nodes (speeds not given: PCIe 4.0
    # x16 ~20 GB/s NCCL bus bandwidth, one 100 Gb/s NIC per node ~10 GB/s assumed); FlashAttention-2 rates.
    "a100-pcie": Hardware(intra_bw=20e9, inter_bw=10e9, intra_lat=50e-6, inter_lat=50e-6, gpus_per_node=4,
                          fwd_tflops=190e12, bwd_tflops=170e12, mem_bw=1.6e12, nics_per_node=1, name="a100-pcie"),
    # tree-attention.txt Sec. 6: DGX H100, 8 GPUs on NVLink 4 (the fabric measured on our H200 pair), one NDR
    # 400 Gb/s NIC per GPU; cuDNN rates as on H200 (same SMs and clocks).
    "h100-ib": Hardware(intra_bw=_NVLINK, inter_bw=_NDR, intra_lat=_NVLINK_LAT, inter_lat=10e-6, gpus_per_node=8,
                        fwd_tflops=_CUDNN_FWD, bwd_tflops=_CUDNN_BWD, mem_bw=3.0e12, p2p_ratio=_NVLINK_P2P,
                        name="h100-ib"),
    # attention2d.txt Sec. 4.3: 64 nodes of one H100 each on Ethernet (speed not given: 100 Gb/s assumed).
    "h100-eth": Hardware(intra_bw=_NVLINK, inter_bw=10e9, intra_lat=_NVLINK_LAT, inter_lat=50e-6, gpus_per_node=1,
                         fwd_tflops=_CUDNN_FWD, bwd_tflops=_CUDNN_BWD, mem_bw=3.0e12, name="h100-eth"),
}
# FlashAttention-2 on H100 (the papers' kernel; FA2-in-torch measured 315-337 fwd, 306-326 fwd+bwd on H200).
FA2_H100 = dict(fwd_tflops=330e12, bwd_tflops=310e12)


def _check_int(name, v, lo=1):
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= lo):
        raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")


@dataclass(frozen=True)
class Problem:
    """One context-parallel attention call (one layer), the unit the algorithms' byte counters count."""

    seq_len: int
    """N, the full sequence length."""
    world: int
    """P, the context-parallel group size."""
    heads: int
    """h, query heads (per tensor-parallel rank)."""
    kv_heads: int | None = None
    """h_kv, key/value heads (h % h_kv == 0); None: h (MHA)."""
    head_dim: int = 128
    """d."""
    batch: int = 1
    """b, sequences per call (micro-batch)."""
    dtype_bytes: int = 2
    """e, element size of q, k, v: 2 (bf16/fp16), 4 (fp32) or 8 (fp64; accumulators are then fp64 too)."""
    causal: bool = True
    """Causal mask (half the FLOPs; the layouts balance it)."""
    grid: tuple[int, int] | None = None
    """Attention2D grid (R, C), R * C == P; None: comm.choose_grid's, as at run time."""
    node_aware: bool = True
    """Attention2D places grid rows inside a node (CPGrid(..., gpus_per_node)) when C divides GPUs per node."""
    backward: bool = True
    """Training (forward + backward) or forward only (prefill): what choose_algo minimises."""

    def __post_init__(self):
        for f in ("seq_len", "world", "heads", "head_dim", "batch"):
            _check_int(f"Problem.{f}", getattr(self, f))
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        _check_int("Problem.kv_heads", self.kv_heads)
        if self.heads % self.kv_heads:
            raise ValueError(f"Problem.heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads})")
        if self.dtype_bytes not in (2, 4, 8):
            raise ValueError(f"Problem.dtype_bytes must be 2, 4 or 8, got {self.dtype_bytes!r}")
        if self.seq_len % self.world:
            raise ValueError(f"Problem.seq_len {self.seq_len} must be divisible by world {self.world}")
        if self.grid is not None:
            g = tuple(self.grid)
            if len(g) != 2 or any(not isinstance(x, int) or x < 1 for x in g) or g[0] * g[1] != self.world:
                raise ValueError(f"Problem.grid must be (rows, cols) with rows * cols == world {self.world}, "
                                 f"got {self.grid!r}")
            object.__setattr__(self, "grid", g)

    @property
    def acc_bytes(self) -> int:
        """Accumulator element size (fp32, fp64 for fp64 inputs), as kernels.local_attn.acc_dtype."""
        return 8 if self.dtype_bytes == 8 else 4

    def attention2d_grid(self) -> tuple[int, int]:
        return self.grid or choose_grid(self.world, h=self.heads, h_kv=self.kv_heads)

    def feasible(self, algo: str) -> bool:
        """Whether `algo`'s layout can shard seq_len (zigzag: 2P chunks; cyclic: P)."""
        return self.seq_len % (self.world if algo.startswith("attention2d") else 2 * self.world) == 0


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
            _check_int(f"DecodeProblem.{f}", getattr(self, f))
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        _check_int("DecodeProblem.kv_heads", self.kv_heads)
        if self.heads % self.kv_heads:
            raise ValueError(f"DecodeProblem.heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads})")
        if self.dtype_bytes not in (2, 4, 8):
            raise ValueError(f"DecodeProblem.dtype_bytes must be 2, 4 or 8, got {self.dtype_bytes!r}")

    @property
    def shard(self) -> int:
        return -(-self.context // self.world)


@dataclass(frozen=True)
class Prediction:
    """Predicted cost of one call on the slowest rank."""

    algo: str
    fwd_s: float
    """Forward seconds."""
    bwd_s: float
    """Backward seconds."""
    fwd_bytes: int
    """Bytes this rank sends in the forward (CommStats.forward_bytes)."""
    bwd_bytes: int
    """Bytes sent in the backward (CommStats.backward_bytes)."""
    fwd_flops: float
    """Attention FLOPs per rank, forward."""
    bwd_flops: float
    """Attention FLOPs per rank, backward."""
    grid: tuple[int, int] | None = None
    """Attention2D's (R, C)."""
    row_major: bool = False
    """Attention2D's placement: grid rows inside a node."""

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s


# ----------------------------------------------------------------------------------------------- links
@dataclass(frozen=True)
class _Link:
    bw: float          # bytes/s of one flow
    lat: float         # seconds per message / call
    nodes: int         # nodes the widest ring or collective of the phase spans

    def t(self, nbytes: float, calls: int = 1) -> float:
        return nbytes / self.bw + calls * self.lat if nbytes else 0.0


def _phase_link(groups, hw: Hardware, *, p2p: bool, collective: str = "gather") -> _Link:
    """The link of a phase in which every group in `groups` (lists of group ranks, in ring order) runs one ring
    (p2p) or one NCCL collective at the same time. Intra-node when no group spans nodes; else inter-node, with
    the NICs of a node shared by the flows that leave it (a p2p ring leaves a node wherever a member's successor
    is elsewhere; NCCL orders a collective's ring by node, so it leaves each node it spans once)."""
    G = hw.gpus_per_node
    node = lambda p: p // G  # noqa: E731
    spans = [len({node(p) for p in g}) for g in groups]
    ratio = hw.p2p_ratio if p2p else 1.0
    if max(spans) <= 1:
        return _Link(hw.intra_bw * ratio, hw.intra_lat, 1)
    flows: dict[int, int] = {}                     # node -> flows leaving it at once
    members: list[tuple[int, int]] = []            # (node, members of one spanning collective on it)
    for g, n in zip(groups, spans):
        if n <= 1:
            continue
        if p2p:
            for i, p in enumerate(g):
                if node(g[(i + 1) % len(g)]) != node(p):
                    flows[node(p)] = flows.get(node(p), 0) + 1
        else:
            for nd in {node(p) for p in g}:
                flows[nd] = flows.get(nd, 0) + 1
                members.append((nd, sum(node(p) == nd for p in g)))
    if p2p:                                        # a p2p flow rides one NIC
        share = min(1.0, hw.nics / max(flows.values()))
    else:                                          # NCCL spreads a collective's channels over its GPUs' NICs
        share = min(min(hw.nics / flows[nd], m * hw.nics / G) for nd, m in members)
    bw = min(hw.inter_bw * share, hw.intra_bw) * ratio
    nodes = max(spans)
    if p2p:
        hops = 1
    elif collective == "allreduce":
        hops = 2 * math.ceil(math.log2(nodes))        # NCCL's tree between nodes (tree-attention.txt Sec. 5.3)
    else:
        hops = nodes - 1                               # ring between nodes
    return _Link(bw, hw.intra_lat + hops * hw.inter_lat, nodes)


def _pairs_link(pairs, hw: Hardware) -> _Link:
    """The link of a permutation: (src, dst) group ranks, all sent at once (one all_to_all)."""
    G = hw.gpus_per_node
    out: dict[int, int] = {}
    for s, d in pairs:
        if s // G != d // G:
            out[s // G] = out.get(s // G, 0) + 1
    if not out:
        return _Link(hw.intra_bw, hw.intra_lat, 1)
    k = max(out.values())
    return _Link(hw.inter_bw * min(1.0, hw.nics / k), hw.intra_lat + hw.inter_lat, 2)


def _overlapped(compute: list[float], comm: list[float]) -> float:
    """Steps whose transfer (comm[i], posted before compute[i]) overlaps the step's compute."""
    return sum(max(c, m) for c, m in zip(compute, comm))


# ----------------------------------------------------------------------------------------------- compute
def attention_flops(pb: Problem) -> tuple[float, float]:
    """(forward, backward) attention FLOPs per rank: 4 b h N^2 d (x 1/2 causal) / P, backward 2.5 x forward."""
    f = 4.0 * pb.batch * pb.heads * pb.seq_len ** 2 * pb.head_dim * (0.5 if pb.causal else 1.0) / pb.world
    return f, 2.5 * f


def _sizes(pb: Problem):
    s = pb.seq_len // pb.world
    n_q = pb.batch * s * pb.heads * pb.head_dim
    n_kv = pb.batch * s * pb.kv_heads * pb.head_dim
    n_r = pb.batch * pb.heads * s
    return s, n_q, n_kv, n_r, pb.dtype_bytes, pb.acc_bytes


# ----------------------------------------------------------------------------------------------- ring, burst
def _ring_family(algo: str, pb: Problem, hw: Hardware) -> Prediction:
    P = pb.world
    _, n_q, n_kv, n_r, e, acc = _sizes(pb)
    F, B = attention_flops(pb)
    link = _phase_link([list(range(P))], hw, p2p=True)
    # Forward (ring.py _forward, also burst's): K, V round the ring; the slowest rank (P - 1 under zigzag
    # causal) merges all its rows at every step.
    m_kv = 2 * n_kv * e
    cf = F / P / hw.fwd_tflops
    merge = n_q * MERGE_BYTES / hw.mem_bw
    comp = [cf] + [cf + merge] * (P - 1)
    fwd = _overlapped(comp[:-1], [link.t(m_kv)] * (P - 1)) + comp[-1]
    fwd_bytes = (P - 1) * m_kv
    # Backward: a travelling block posted before the step's compute, and a gradient accumulator sent after it
    # (waited one step later), which the last hop brings home after the loop.
    cb = B / P / hw.bwd_tflops
    if algo == "ring":                  # K, V and dK, dV (fp32)
        m_blk, m_acc = 2 * n_kv * e, 2 * n_kv * acc
    else:                               # burst: Q, dO, D, lse and dQ (fp32); K, V stay
        m_blk, m_acc = 2 * n_q * e + 2 * n_r * acc, n_q * acc
    adds = (n_q + 2 * n_kv) * ADD_BYTES / hw.mem_bw     # both add a dQ and a dK, dV block per step
    comp = [cb + adds] * P
    comm = [link.t(m_blk + (m_acc if i >= 2 else 0), 2 if i >= 2 else 1) for i in range(P - 1)]
    bwd = (_overlapped(comp[:-1], comm) + max(comp[-1], link.t(m_acc) if P > 2 else 0.0)
           + (link.t(m_acc) if P > 1 else 0.0))
    bwd_bytes = (P - 1) * (m_blk + m_acc)
    return Prediction(algo, fwd, bwd, fwd_bytes, bwd_bytes, F, B)


# ----------------------------------------------------------------------------------------------- attention2d
def _grid_groups(P, R, C, row_major):
    at = lambda i, j: grid_rank(i, j, R, C, row_major)  # noqa: E731
    rows = [[at(i, j) for j in range(C)] for i in range(R)]
    cols = [[at(i, j) for i in range(R)] for j in range(C)]
    return rows, cols


def _row_major(pb: Problem, gpus_per_node: int | None) -> bool:
    """CPGrid's placement rule: row-major when asked for (node_aware) and the columns divide a node."""
    _, C = pb.attention2d_grid()
    return bool(pb.node_aware and gpus_per_node is not None and gpus_per_node % C == 0)


def _attention2d(algo: str, pb: Problem, hw: Hardware, rank: int | None = None) -> Prediction:
    P = pb.world
    R, C = pb.attention2d_grid()
    row_major = _row_major(pb, hw.gpus_per_node)
    _, n_q, n_kv, n_r, e, acc = _sizes(pb)
    F, B = attention_flops(pb)
    rows, cols = _grid_groups(P, R, C, row_major)
    moving = [(p, grid_rank(p // C, p % C, R, C, row_major)) for p in range(P) if kv_moves(p, R, C, row_major)]
    perm_t = _pairs_link(moving, hw).t(2 * n_kv * e) if moving else 0.0
    c1, c1b = F / (R * C) / hw.fwd_tflops, B / (R * C) / hw.bwd_tflops     # one (Q chunk, KV chunk) block
    mg = n_q * MERGE_BYTES / hw.mem_bw
    add_q, add_kv = n_q * ADD_BYTES / hw.mem_bw, 2 * n_kv * ADD_BYTES / hw.mem_bw
    # Forward bytes (attention2d.py / attention2d_o.py; comm.attention2d_bytes).
    q_g = (C - 1) * n_q * e                       # Q gathered in the row
    kv_g = (R - 1) * 2 * n_kv * e                 # K, V gathered in the column
    fix = (C - 1) * (n_q + n_r) * acc             # AttnFix reduce-scatter of (o w, w) / the o ring
    # Backward bytes.
    qdo_g = (C - 1) * 2 * n_q * e                 # Q, dO in the row
    stat_g = (C - 1) * 2 * n_r * acc              # D, lse in the row
    dq_rs = (C - 1) * n_q * acc                   # dQ reduce-scattered in the row
    dkv_rs = (R - 1) * 2 * n_kv * acc             # dK, dV in the column
    if algo == "attention2d-no":
        row = _phase_link(rows, hw, p2p=False) if C > 1 else None
        col = _phase_link(cols, hw, p2p=False) if R > 1 else None
        row_ar = _phase_link(rows, hw, p2p=False, collective="allreduce") if C > 1 else None
        tr = lambda n, calls=1: row.t(n, calls) if row else 0.0  # noqa: E731
        tc = lambda n, calls=1: col.t(n, calls) if col else 0.0  # noqa: E731
        amax = 2 * (C - 1) * n_r * acc            # the row all-reduce max of lse
        fwd = (perm_t + tr(q_g) + tc(kv_g) + F / hw.fwd_tflops + C * (R - 1) * mg
               + (row_ar.t(amax) + tr(fix) + C * n_q * ATTNFIX_BYTES / hw.mem_bw if C > 1 else 0.0))
        bwd = (tr(qdo_g, 2) + tr(stat_g) + tc(kv_g) + B / hw.bwd_tflops + R * C * (add_q + add_kv)
               + tr(dq_rs) + tc(dkv_rs) + perm_t)
    else:
        row = _phase_link(rows, hw, p2p=True) if C > 1 else None
        col = _phase_link(cols, hw, p2p=True) if R > 1 else None
        tr = lambda n: row.t(n) if row and n else 0.0  # noqa: E731
        tc = lambda n: col.t(n) if col and n else 0.0  # noqa: E731

        def chain(block, msg, own_extra):
            """R blocks while R - 1 messages pass round the column, each forwarded after it arrives."""
            return _overlapped([block] * (R - 1), [tc(msg)] * (R - 1)) + block + own_extra

        # Forward (Alg. 4-6): t = 0 computes the own Q block against K, V as they arrive; t >= 1 each arriving
        # Q block against all of them, its partial (o, lse) passed round the row one step behind.
        m_fix = (n_q + n_r) * acc
        t0 = max(chain(c1 + mg, 2 * n_kv * e, -mg), tr(n_q * e) if C > 1 else 0.0)
        steps = [max(R * c1 + (R - 1) * mg + (mg if t >= 2 else 0.0),
                     tr((n_q * e if t + 1 < C else 0) + (m_fix if t >= 2 else 0))) for t in range(1, C)]
        fwd = perm_t + t0 + sum(steps) + (tr(m_fix) + mg if C > 1 else 0.0)
        # Backward (Alg. 8-11): the same with (Q, dO, D, lse) round the row, dQ one step behind it, and in the
        # last pass every K, V chunk's dK, dV accumulator passed down the column.
        blk = 2 * n_q * e + 2 * n_r * acc
        per = c1b + add_q + add_kv
        t0 = max(chain(per, 2 * n_kv * e, 0.0), tr(blk) if C > 1 else 0.0)
        if C == 1:
            t0 = max(t0, chain(per, 2 * n_kv * acc, 0.0))
        steps = []
        for t in range(1, C):
            s_t = max(R * per, tr((blk if t + 1 < C else 0) + (n_q * acc if t >= 2 else 0)))
            if t == C - 1:
                s_t = max(s_t, chain(per, 2 * n_kv * acc, 0.0))
            steps.append(s_t)
        bwd = t0 + sum(steps) + tr(n_q * acc) + tc(2 * n_kv * acc) + perm_t
    # The byte totals are comm.attention2d_bytes' (the one formula the counters are tested against); the
    # per-phase terms above only time them.
    fwd_bytes, bwd_bytes = attention2d_bytes(seq_len=pb.seq_len, world=P, rows=R, cols=C, b=pb.batch, h=pb.heads,
                                             h_kv=pb.kv_heads, d=pb.head_dim, elem=e, acc=acc,
                                             overlap=algo == "attention2d-o", row_major=row_major, rank=rank)
    return Prediction(algo, fwd, bwd, fwd_bytes, bwd_bytes, F, B, (R, C), row_major)


# ----------------------------------------------------------------------------------------------- public
def predict(algo: str, pb: Problem, hw: Hardware) -> Prediction:
    """Predicted forward / backward seconds, bytes and FLOPs of `algo` (one of ALGORITHMS) on `hw`."""
    if algo not in ALGORITHMS:
        raise ValueError(f"algo must be one of {ALGORITHMS}, got {algo!r}")
    if not isinstance(pb, Problem) or not isinstance(hw, Hardware):
        raise ValueError("predict(algo, problem: Problem, hardware: Hardware)")
    if not pb.feasible(algo):
        raise ValueError(f"seq_len {pb.seq_len} cannot be sharded for {algo} over {pb.world} ranks "
                         f"(zigzag needs a multiple of 2P, cyclic of P)")
    if algo.startswith("attention2d"):
        return _attention2d(algo, pb, hw)
    return _ring_family(algo, pb, hw)


def comm_bytes(algo: str, pb: Problem, *, gpus_per_node: int | None = None, rank: int | None = None) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends in `algo`, as its CommStats counts them. Attention2D: the grid
    is placed row-major when pb.node_aware and `gpus_per_node` (CPGrid's argument) is a multiple of C; `rank`
    picks a rank (its K, V may or may not move in the permutation), None the largest."""
    if algo not in ALGORITHMS:
        raise ValueError(f"algo must be one of {ALGORITHMS}, got {algo!r}")
    if rank is not None and not 0 <= rank < pb.world:
        raise ValueError(f"rank must be in [0, {pb.world}), got {rank}")
    hw = dataclasses.replace(HARDWARE["h200-nvlink"], gpus_per_node=gpus_per_node or 1 << 20)
    if algo.startswith("attention2d"):
        pred = _attention2d(algo, dataclasses.replace(pb, node_aware=pb.node_aware and gpus_per_node is not None),
                            hw, rank)
    else:
        pred = _ring_family(algo, pb, hw)
    return pred.fwd_bytes, pred.bwd_bytes


def choose_algo(problem: Problem, hardware: Hardware, candidates=ALGORITHMS) -> tuple[str, dict[str, float]]:
    """The candidate with the smallest predicted time (fwd + bwd, or fwd when not problem.backward), and every
    feasible candidate's prediction in seconds. Ties go to the earlier candidate."""
    cands = tuple(candidates)
    if not cands:
        raise ValueError("choose_algo: candidates is empty")
    for a in cands:
        if a not in ALGORITHMS:
            raise ValueError(f"candidates must be among {ALGORITHMS}, got {a!r}")
    times = {}
    for a in cands:
        if problem.feasible(a):
            p = predict(a, problem, hardware)
            times[a] = p.total_s if problem.backward else p.fwd_s
    if not times:
        raise ValueError(f"seq_len {problem.seq_len} cannot be sharded over {problem.world} ranks by any of {cands}")
    best = min(times, key=lambda a: (times[a], cands.index(a)))
    return best, times


# ----------------------------------------------------------------------------------------------- decode
def decode_bytes(method: str, pb: DecodeProblem) -> int:
    """Bytes one rank sends in one decode call of `method` (DECODE_METHODS), with comm.py's convention.
    tree_decode's validation all-gather (validate=True; generation passes False) is not included."""
    if method not in DECODE_METHODS:
        raise ValueError(f"method must be one of {DECODE_METHODS}, got {method!r}")
    P, acc = pb.world, 8 if pb.dtype_bytes == 8 else 4
    o = pb.batch * pb.n_q * pb.heads * pb.head_dim * acc           # o / numerator, fp32
    r = pb.batch * pb.heads * pb.n_q * acc                         # lse / max / denominator, fp32
    ar = lambda n: 2 * (P - 1) * n // P  # noqa: E731               all-reduce
    if method == "tree-allreduce3":
        return ar(r) + ar(o) + ar(r)
    if method == "tree-allreduce2":
        return ar(r) + ar(o + r)
    if method == "tree-allgather":
        return (P - 1) * (o + r)
    return (P - 1) * _ring_decode_msg(pb)


def _ring_decode_msg(pb: DecodeProblem) -> int:
    kv = 2 * pb.batch * pb.shard * pb.kv_heads * pb.head_dim * pb.dtype_bytes
    return kv + (pb.batch * pb.shard * 8 if pb.positions else 0)


def predict_decode(method: str, pb: DecodeProblem, hw: Hardware, *, graphed: bool = False) -> float:
    """Predicted seconds of one decode call (one layer) of `method` on `hw`. Host overhead: LAUNCH_S per kernel
    eagerly; graphed (the step replayed as a CUDA graph): GRAPH_LAUNCH_S per kernel and collective latencies
    scaled by GRAPH_LATENCY_RATIO."""
    if method not in DECODE_METHODS:
        raise ValueError(f"method must be one of {DECODE_METHODS}, got {method!r}")
    P, acc = pb.world, 8 if pb.dtype_bytes == 8 else 4
    k = _DECODE_KERNELS
    launch = GRAPH_LAUNCH_S if graphed else LAUNCH_S

    def link(**kw) -> _Link:
        lk = _phase_link([list(range(P))], hw, **kw)
        return dataclasses.replace(lk, lat=lk.lat * GRAPH_LATENCY_RATIO) if graphed else lk

    # The local flash-decode step streams its K, V shard from HBM; its FLOPs (4 b n_q h s d) are negligible.
    local = 2 * pb.batch * pb.shard * pb.kv_heads * pb.head_dim * pb.dtype_bytes / hw.mem_bw + k["local"] * launch
    if P == 1:
        return local
    merge = pb.batch * pb.n_q * pb.heads * pb.head_dim * MERGE_BYTES / hw.mem_bw + k["merge"] * launch
    if method == "ring-decode":
        steps = [local] + [local + merge] * (P - 2)
        return _overlapped(steps, [link(p2p=True).t(_ring_decode_msg(pb))] * (P - 1)) + local + merge
    o = pb.batch * pb.n_q * pb.heads * pb.head_dim * acc
    r = pb.batch * pb.heads * pb.n_q * acc
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


def choose_tree_variant(pb: DecodeProblem, hw: Hardware, *, graphed: bool) -> tuple[str, dict[str, float]]:
    """tree_decode's merge variant ("allreduce3" | "allreduce2" | "allgather") the model predicts fastest for
    one layer, eager or graphed, and every variant's predicted seconds (keyed by variant)."""
    best, times = choose_decode(pb, hw, DECODE_METHODS[:3], graphed=graphed)
    return best.split("-", 1)[1], {m.split("-", 1)[1]: t for m, t in times.items()}


# ----------------------------------------------------------------------------------------------- tables
def _fmt_s(t: float) -> str:
    ms = t * 1e3
    return f"{ms:.3g}" if ms < 1000 else f"{ms:.0f}"


def _k(n: int) -> str:
    return f"{n // 1048576}M" if n % 1048576 == 0 else f"{n // 1024}k" if n % 1024 == 0 else str(n)


# Measured on 2 x H200 (docs/results/cp_attention*.md): (S, algo) -> (fwd ms, fwd+bwd ms), b=1 h=16 d=128 causal.
MEASURED_NVLINK = {
    (32768, "ring"): (4.65, 17.1), (32768, "burst"): (4.63, 17.4), (32768, "attention2d-no"): (5.72, 20.1),
    (32768, "attention2d-o"): (5.36, 19.1), (131072, "ring"): (62.1, 236), (131072, "burst"): (63.4, 236),
    (131072, "attention2d-no"): (66.5, 248), (131072, "attention2d-o"): (65.3, 246)}
MEASURED_SOCKETS = {
    (32768, "ring"): (55.9, 227), (32768, "burst"): (57.0, 178), (32768, "attention2d-no"): (62.1, 152),
    (32768, "attention2d-o"): (84.1, 201), (131072, "ring"): (264, 983), (131072, "burst"): (268, 727),
    (131072, "attention2d-no"): (258, 719), (131072, "attention2d-o"): (427, 968)}
# docs/results/decode*.md: 2 x H200, h=32, h_kv=8, d=128, b=1, one token; us per layer (ranges over reruns).
MEASURED_DECODE = {
    (32768, "tree-allreduce3"): "1010", (32768, "tree-allreduce2"): "1020", (32768, "tree-allgather"): "1150",
    (32768, "ring-decode"): "1110", (131072, "tree-allreduce3"): "563-982", (131072, "tree-allreduce2"): "497-1010",
    (131072, "tree-allgather"): "702-1130", (131072, "ring-decode"): "1270-1350",
    (524288, "tree-allreduce3"): "966", (524288, "tree-allreduce2"): "456", (524288, "tree-allgather"): "574",
    (524288, "ring-decode"): "3540"}


def _rel(pred: float, meas: float) -> str:
    return f"{(pred - meas) / meas:+.0%}"


def table_measured() -> str:
    """Predictions against the P = 2 measurements (NVLink and sockets) and the decode measurements."""
    out = []
    for hw_name, meas in (("h200-nvlink", MEASURED_NVLINK), ("h200-sockets", MEASURED_SOCKETS)):
        hw = HARDWARE[hw_name]
        out.append(f"\n{hw_name} (P = 2, b = 1, h = h_kv = 16, d = 128, bf16, causal; ms)\n")
        out.append("| S | algo | grid | pred fwd | meas fwd | err | pred fwd+bwd | meas fwd+bwd | err |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        for (S, algo), (mf, mt) in meas.items():
            p = predict(algo, Problem(S, 2, 16), hw)
            g = f"{p.grid[0]}x{p.grid[1]}" if p.grid else "-"
            out.append(f"| {_k(S)} | {algo} | {g} | {_fmt_s(p.fwd_s)} | {mf:g} | {_rel(p.fwd_s * 1e3, mf)} | "
                       f"{_fmt_s(p.total_s)} | {mt:g} | {_rel(p.total_s * 1e3, mt)} |")
    hw = HARDWARE["h200-nvlink"]
    out.append("\nh200-nvlink decode (P = 2, h = 32, h_kv = 8, d = 128, b = 1, 1 token; us per layer)\n")
    out.append("| context | method | pred us | meas us | pred / meas |")
    out.append("|---|---|---|---|---|")
    for (S, m), meas in MEASURED_DECODE.items():
        t = predict_decode(m, DecodeProblem(S, 2, 32, 8), hw) * 1e6
        lo, hi = (float(x) for x in (meas.split("-") * 2)[:2])
        ratio = f"{t / hi:.2f}" if lo == hi else f"{t / hi:.2f}-{t / lo:.2f}"
        out.append(f"| {_k(S)} | {m} | {t:.0f} | {meas} | {ratio} |")
    return "\n".join(out)


def _node_aware_best(pb: Problem, hw: Hardware) -> Problem:
    """pb on the grid, among those whose columns fit in a node (row-major placement), that the model likes best."""
    grids = [(pb.world // c, c) for c in range(1, hw.gpus_per_node + 1)
             if hw.gpus_per_node % c == 0 and pb.world % c == 0]
    return min((dataclasses.replace(pb, grid=g, node_aware=True) for g in grids),
               key=lambda q: predict("attention2d-no", q, hw).total_s)


def _speedups(pb: Problem, hw: Hardware) -> tuple[float, str]:
    t = {a: predict(a, pb, hw).total_s for a in ALGORITHMS}
    return t["ring"], f"{t['ring'] / t['attention2d-no']:.1f} / {t['ring'] / t['attention2d-o']:.1f}"


def table_papers() -> str:
    """The papers' settings: Attention2D vs ring (attention2d.txt Sec. 4.1, 4.3), tree vs ring decode
    (tree-attention.txt Sec. 6.1), next to their claims."""
    out = []
    a100 = HARDWARE["a100-pcie"]
    a100_nics = dataclasses.replace(a100, nics_per_node=None)
    out.append("\nattention2d.txt Sec. 4.1: A100 nodes of 4 GPUs on PCIe, Ethernet between nodes (a100-pcie: FA2 "
               f"{a100.fwd_tflops / 1e12:.0f}/{a100.bwd_tflops / 1e12:.0f} TFLOP/s, PCIe {a100.intra_bw / 1e9:.0f} "
               f"GB/s, one {a100.inter_bw / 1e9:.0f} GB/s NIC per node). b = 1, causal, bf16, one layer fwd+bwd. "
               "Cells: speed-up of attention2d-no / attention2d-o over ring. Paper: more than 2x for every model "
               "and length on 16 and 64 GPUs, up to 5x on 64.\n")
    out.append("| model (h, d) | P | S | ring ms | column-major grid (paper) | node-aware grid | column-major, "
               "one NIC per GPU |")
    out.append("|---|---|---|---|---|---|---|")
    for name, h, d in (("760M", 16, 96), ("2.7B", 32, 80), ("13B", 40, 128)):
        for P in (16, 64):
            for S in (65536, 262144, 524288):
                pb = Problem(S, P, h, head_dim=d, node_aware=False)
                ring, col = _speedups(pb, a100)
                aware = _node_aware_best(pb, a100)
                _, aw = _speedups(aware, a100)
                _, nic = _speedups(pb, a100_nics)
                g, ga = pb.attention2d_grid(), aware.grid
                out.append(f"| {name} ({h}, {d}) | {P} | {_k(S)} | {_fmt_s(ring)} | {col} ({g[0]}x{g[1]}) | "
                           f"{aw} ({ga[0]}x{ga[1]}) | {nic} |")
    eth = dataclasses.replace(HARDWARE["h100-eth"], **FA2_H100)
    eth_p2p = dataclasses.replace(eth, p2p_ratio=HARDWARE["h200-sockets"].p2p_ratio)
    out.append("\nattention2d.txt Sec. 4.3: 64 nodes of one H100 on Ethernet (h100-eth with FA2 rates "
               f"{eth.fwd_tflops / 1e12:.0f}/{eth.bwd_tflops / 1e12:.0f} TFLOP/s, {eth.inter_bw / 1e9:.0f} GB/s per "
               "node), "
               "P = 64, 8 x 8 grid, b = 1, causal, bf16, one layer fwd+bwd. Cells: speed-up of attention2d-no / "
               "attention2d-o over ring. Paper: up to 9.4x (66B and 175B, one pipeline stage).\n")
    out.append(f"| model (h, d) | S | ring ms | speed-up | speed-up with p2p at {eth_p2p.p2p_ratio:g} of the "
               "collectives' "
               "bandwidth (as measured over sockets) |")
    out.append("|---|---|---|---|---|")
    for name, h, d in (("66B", 72, 128), ("175B", 96, 128)):
        for S in (65536, 131072, 262144, 524288):
            pb = Problem(S, 64, h, head_dim=d)
            ring, sp = _speedups(pb, eth)
            _, sp2 = _speedups(pb, eth_p2p)
            out.append(f"| {name} ({h}, {d}) | {_k(S)} | {_fmt_s(ring)} | {sp} | {sp2} |")
    hw = HARDWARE["h100-ib"]
    out.append("\ntree-attention.txt Sec. 6.1: DGX H100 nodes (8 GPUs on NVLink, one NDR NIC per GPU: h100-ib), 16 "
               "heads, d = 128, b = 1, one new token, bf16; us per layer (8 us per kernel launch). Paper: tree "
               "'close to 8x' faster than ring at 128 GPUs and 5.12M tokens.\n")
    out.append("| GPUs | context | tree-allreduce2 | tree-allreduce3 | tree-allgather | ring-decode | "
               "ring / tree-allreduce2 |")
    out.append("|---|---|---|---|---|---|---|")
    for P in (8, 64, 128):
        for S in (640000, 1280000, 5120000):
            dp = DecodeProblem(S, P, 16)
            t = {m: predict_decode(m, dp, hw) * 1e6 for m in DECODE_METHODS}
            out.append(f"| {P} | {S / 1e6:g}M | {t['tree-allreduce2']:.0f} | {t['tree-allreduce3']:.0f} | "
                       f"{t['tree-allgather']:.0f} | {t['ring-decode']:.0f} | "
                       f"{t['ring-decode'] / t['tree-allreduce2']:.0f} |")
    return "\n".join(out)


def table_node8(hw_names=("h200-nvlink", "h200-sockets")) -> str:
    """P = 4 and 8 on one 8 x H200 node: every algorithm, fwd and fwd+bwd, S 128k-512k, h 16 / 32, h_kv h and h/4."""
    out = []
    for hw_name in hw_names:
        hw = HARDWARE[hw_name]
        out.append(f"\n{hw_name}: b = 1, d = 128, bf16, causal; ms per layer (fwd / fwd+bwd); default grid, "
                   f"column-major (as bench.cp_attention runs it); 'auto' = choose_algo's pick for fwd+bwd\n")
        out.append("| P | S | h/h_kv | ring | burst | attention2d-no | attention2d-o | grid | auto |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        for P in (4, 8):
            for S in (131072, 262144, 524288):
                for h in (16, 32):
                    for hk in (h, h // 4):
                        pb = Problem(S, P, h, hk, node_aware=False)
                        t = {a: predict(a, pb, hw) for a in ALGORITHMS}
                        g = t["attention2d-no"].grid
                        best, _ = choose_algo(pb, hw)
                        out.append(f"| {P} | {_k(S)} | {h}/{hk} | " + " | ".join(
                            f"{_fmt_s(t[a].fwd_s)} / {_fmt_s(t[a].total_s)}" for a in ALGORITHMS)
                            + f" | {g[0]}x{g[1]} | {best} |")
    return "\n".join(out)


def table_decode(hw_names=("h200-nvlink", "h200-sockets")) -> str:
    """Decode on one 8 x H200 node, Llama-3.1-8B attention (32 heads, 8 KV heads, d = 128), b = 1, one token."""
    out = []
    for hw_name in hw_names:
        hw = HARDWARE[hw_name]
        out.append(f"\n{hw_name}: Llama-3.1-8B attention (h = 32, h_kv = 8, d = 128), b = 1, 1 token, bf16; us per "
                   "layer (8 us per kernel launch)\n")
        out.append("| P | context | tree-allreduce3 | tree-allreduce2 | tree-allgather | ring-decode | one GPU | "
                   "ring / best tree |")
        out.append("|---|---|---|---|---|---|---|---|")
        for P in (2, 4, 8):
            for S in (32768, 131072, 524288, 1048576):
                dp = DecodeProblem(S, P, 32, 8)
                t = {m: predict_decode(m, dp, hw) * 1e6 for m in DECODE_METHODS}
                one = predict_decode("tree-allreduce2", dataclasses.replace(dp, world=1), hw) * 1e6
                tree = min(t[m] for m in DECODE_METHODS[:3])
                out.append(f"| {P} | {_k(S)} | " + " | ".join(f"{t[m]:.0f}" for m in DECODE_METHODS)
                           + f" | {one:.0f} | {t['ring-decode'] / tree:.1f} |")
    return "\n".join(out)


TABLES = {"measured": table_measured, "papers": table_papers, "node8": table_node8, "decode": table_decode}


def main(argv=None) -> int:
    """`python -m megatron_cp_plugin.cost_model`: print tables, or the prediction for one problem."""
    p = argparse.ArgumentParser(prog="python -m megatron_cp_plugin.cost_model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", nargs="+", choices=sorted(TABLES) + ["all"], default=None)
    p.add_argument("--hardware", choices=sorted(HARDWARE), default="h200-nvlink")
    p.add_argument("--seq", type=int, default=None, help="one problem: sequence length (with --cp)")
    p.add_argument("--cp", type=int, default=2, help="context-parallel size")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--grid", default=None, metavar="RxC")
    a = p.parse_args(argv)
    if a.table is None and a.seq is None:
        p.error("give --table or --seq")
    for name in (sorted(TABLES) if a.table and "all" in a.table else a.table or []):
        print(f"## {name}\n{TABLES[name]()}\n")
    if a.seq is not None:
        grid = tuple(int(x) for x in a.grid.lower().split("x")) if a.grid else None
        pb = Problem(a.seq, a.cp, a.heads, a.kv_heads, a.head_dim, a.batch, grid=grid)
        hw = HARDWARE[a.hardware]
        best, _ = choose_algo(pb, hw)
        for algo in ALGORITHMS:
            if pb.feasible(algo):
                r = predict(algo, pb, hw)
                print(f"{algo:15s} fwd {r.fwd_s * 1e3:9.3f} ms  fwd+bwd {r.total_s * 1e3:9.3f} ms  "
                      f"sent {r.fwd_bytes / 2**20:9.1f} + {r.bwd_bytes / 2**20:9.1f} MiB"
                      + (f"  grid {r.grid[0]}x{r.grid[1]}" if r.grid else ""))
        print(f"choose_algo: {best}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
