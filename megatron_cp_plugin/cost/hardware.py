"""The hardware side of the cost model (model.py, collective.py, decode.py): cluster presets and the time a phase's
bytes take over the links it crosses.

A phase's link is the slowest one its ring or collective crosses: intra-node, or inter-node when its members span
nodes. Inter-node flows that leave one node at the same time share its NICs (a p2p flow rides one NIC; NCCL
spreads a collective's channels over its members' NICs). Where the preset figures come from: docs/cost_model.md
and docs/design.md (measured figures behind h200-nvlink).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


# Memory-bound steps, in bytes of HBM traffic per element at `Hardware.mem_bw`. merge_ (kernels/merge.py) is one
# Triton kernel: o read and written in fp32 (8), a bf16 block read (2); 0.16 ms for 33.5M elements and 0.52 ms for
# 134M on one H100 (`megatron-cp-bench merge`: 2.1-2.6 TB/s of its measured 2.97 TB/s copy bandwidth). The former
# six-kernel PyTorch merge measured 54-67 bytes an element (0.532 ms for 33.5M on H200); what a rank's other
# launches cost beyond these bytes is in each algorithm's fitted factor (compute.py, configs/rank_compute.json).
MERGE_BYTES = 10
# A gradient-accumulator add (fp32 += block result): read 4 + 4, write 4.
ADD_BYTES = 12
# AttnFix (Attention2D-NO): exp of lse, o * w, the packed copy and the final divide, ~3 elementwise passes.
ATTNFIX_BYTES = 30


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


_CUDNN_FWD = 600e12    # cuDNN causal fwd on H200, 603-616 TFLOP/s at 16k-64k (docs/design.md; 562 at 128k)
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
    # p2p_ratio refitted on all 16 figures after issue 16 dropped Attention2D's max all-reduce: 0.64 -> 0.65.
    "h200-sockets": Hardware(intra_bw=3.7e9, inter_bw=3.7e9, intra_lat=100e-6, inter_lat=100e-6, gpus_per_node=8,
                             fwd_tflops=_CUDNN_FWD, bwd_tflops=_CUDNN_BWD, mem_bw=4.2e12, p2p_ratio=0.65,
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


def check_int(name, v, lo=1):
    """The cost model's dataclasses' argument check: an integer (not a bool) >= lo."""
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= lo):
        raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")


# ----------------------------------------------------------------------------------------------- links
@dataclass(frozen=True)
class Link:
    """The link one flow of a phase sees."""

    bw: float          # bytes/s of one flow
    lat: float         # seconds per message / call
    nodes: int         # nodes the widest ring or collective of the phase spans

    def t(self, nbytes: float, calls: int = 1) -> float:
        return nbytes / self.bw + calls * self.lat if nbytes else 0.0


def phase_link(groups, hw: Hardware, *, p2p: bool, collective: str = "gather") -> Link:
    """The link of a phase in which every group in `groups` (lists of group ranks, in ring order) runs one ring
    (p2p) or one NCCL collective at the same time. Intra-node when no group spans nodes; else inter-node, with
    the NICs of a node shared by the flows that leave it (a p2p ring leaves a node wherever a member's successor
    is elsewhere; NCCL orders a collective's ring by node, so it leaves each node it spans once)."""
    G = hw.gpus_per_node
    node = lambda p: p // G  # noqa: E731
    spans = [len({node(p) for p in g}) for g in groups]
    ratio = hw.p2p_ratio if p2p else 1.0
    if max(spans) <= 1:
        return Link(hw.intra_bw * ratio, hw.intra_lat, 1)
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
    return Link(bw, hw.intra_lat + hops * hw.inter_lat, nodes)


def pairs_link(pairs, hw: Hardware) -> Link:
    """The link of a permutation: (src, dst) group ranks, all sent at once (one all_to_all)."""
    G = hw.gpus_per_node
    out: dict[int, int] = {}
    for s, d in pairs:
        if s // G != d // G:
            out[s // G] = out.get(s // G, 0) + 1
    if not out:
        return Link(hw.intra_bw, hw.intra_lat, 1)
    k = max(out.values())
    return Link(hw.inter_bw * min(1.0, hw.nics / k), hw.intra_lat + hw.inter_lat, 2)


def overlapped(compute: list[float], comm: list[float]) -> float:
    """Steps whose transfer (comm[i], posted before compute[i]) overlaps the step's compute."""
    return sum(max(c, m) for c, m in zip(compute, comm))
