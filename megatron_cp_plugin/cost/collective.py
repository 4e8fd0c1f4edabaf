"""The cost-model entries of the collective algorithms: allgather (algos/allgather.py), ulysses
(algos/ulysses.py) and ulysses-ring (algos/ulysses_ring.py). Each row of algos/registry.py names its entry here;
model.py holds the ring and Attention2D entries and the shared Problem, Prediction and `choose_algo`.

Bytes are exactly what the algorithms' CommStats counters count (tests/test_cost_model.py, test_cp_attention.py
assert equality on gloo), with comm.py's convention (an all-gather or all-to-all over g ranks sends g - 1
chunks). Times: the collectives are waited for (no overlap: sum of transfer and compute); ulysses-ring's ring
steps overlap as ring's do. A shape whose heads an all-to-all cannot split predicts an infinite time (so `auto`
never picks it) and no bytes.
"""
from __future__ import annotations

import math

from ..comm import wire_bytes
from .hardware import ADD_BYTES, MERGE_BYTES, overlapped, phase_link
from .model import Prediction, Problem, _sizes, attention_flops


# ----------------------------------------------------------------------------------------------- bytes
def allgather_bytes(pb: Problem) -> tuple[int, int]:
    """(forward, backward) bytes per rank: K, V gathered, (P-1) 2 n_kv e; the backward gathers them again and
    sends every other owner its dK, dV partial in the input dtype (summed at the owner), (P-1) 4 n_kv e."""
    _, _, n_kv, _, e, _ = _sizes(pb)
    P = pb.world
    return (P - 1) * 2 * n_kv * e, (P - 1) * 4 * n_kv * e


def heads_allow(h: int, h_kv: int, u: int) -> bool:
    """Whether an all-to-all over u ranks can split h q heads (any h_kv: each member gets the K, V heads its q
    heads read, algos/ulysses.py `kv_spans`)."""
    return h % u == 0


def _kv_counts(pb: Problem, u: int) -> list[int]:
    """k_j, the K, V heads member j of an all-to-all over u ranks gets."""
    from ..algos.ulysses import kv_spans  # noqa: PLC0415

    return [hi - lo for lo, hi in kv_spans(pb.heads, pb.kv_heads, u)]


def ulysses_bytes(pb: Problem, u: int | None = None, rank: int | None = None) -> tuple[int, int]:
    """(forward, backward) bytes `rank` sends (None: the largest of each over the ranks) in the head all-to-all
    over u ranks (None: all P, i.e. ulysses) and the ring across the P / u groups. Member j = rank % u of its
    group gets k_j K, V heads (K = k_0 + .. + k_{u-1}): forward (u-1) b s d e 2 h / u + 2 b s d e (K - k_j) (Q; K, V
    to the members that read them; O back), backward (u-1) b s d e (2 h / u + 2 k_j) (dO; dQ, dK, dV back): both
    (u-1) b s d e (2 h / u + 2 k) where every k_j = k (h_kv / u, or 1 for replicated K, V heads). The ring
    (P/u - 1) 2 n' e forward, (P/u - 1) 2 n' (e + a) backward (a = e for a ring of two groups: one hop), with n' =
    b u s k_j d the K, V a rank holds after the all-to-all."""
    s, _, _, _, e, acc = _sizes(pb)
    u = pb.world if u is None else u
    if not heads_allow(pb.heads, pb.kv_heads, u):
        return 0, 0
    k, b, d, g = _kv_counts(pb, u), pb.batch, pb.head_dim, pb.world // u
    w = acc if pb.fp32_one_hop else wire_bytes(g - 1, e, acc)      # the ring's dK, dV: one hop (g = 2) in e
    unit, q = b * s * d * e, (u - 1) * b * s * d * e * 2 * pb.heads // u

    def member(j):
        n_kv = b * u * s * k[j] * d
        return (q + 2 * unit * (sum(k) - k[j]) + (g - 1) * 2 * n_kv * e,
                q + (u - 1) * 2 * unit * k[j] + (g - 1) * 2 * n_kv * (e + w))

    if rank is not None:
        return member(rank % u)                 # groups of u consecutive ranks, members in rank order
    per = [member(j) for j in range(u)]
    return max(f for f, _ in per), max(w for _, w in per)


def ulysses_grid(pb: Problem) -> tuple[int, int]:
    """ulysses-ring's (R, U): pb.grid, else the runtime default (algos/ulysses_ring.py `default_grid`)."""
    from ..algos import registry  # noqa: PLC0415

    return pb.grid or registry.get("ulysses-ring").grid_shape(pb.world, pb.heads, pb.kv_heads)


# ----------------------------------------------------------------------------------------------- entries
def a2a_time(nbytes: float, u: int, hw) -> float:
    """Seconds of an all-to-all in which every rank of groups of u consecutive ranks sends `nbytes`, spread evenly
    over its u - 1 peers, all groups at once: the chunks to peers on other nodes leave through the node's NICs,
    which every GPU of the node shares at that moment (unlike a ring collective, whose one flow per node crosses);
    the others ride NVLink; both at once."""
    if u <= 1 or not nbytes:
        return 0.0
    G = hw.gpus_per_node
    on_node = min(u, G) - 1 if u > G or G % u == 0 else u - 1         # peers on this rank's node
    off = nbytes * (u - 1 - on_node) / (u - 1)
    share = min(1.0, hw.nics / G)
    t = max(off / (hw.inter_bw * share), (nbytes - off) / hw.intra_bw)
    return t + hw.intra_lat + (hw.inter_lat if off else 0.0)


def _infeasible(algo, pb, grid=None):
    F, B = attention_flops(pb)
    return Prediction(algo, math.inf, math.inf, 0, 0, F, B, grid)


def allgather_cost(algo: str, pb: Problem, hw, rank: int | None = None) -> Prediction:
    """One all-gather, overlapped with the own block (1/P of the rank's work, causal zigzag or not), the other
    P - 1 blocks merged; then the same backward with one all-to-all of partials."""
    P = pb.world
    _, n_q, n_kv, _, e, _ = _sizes(pb)
    F, B = attention_flops(pb)
    fwd_bytes, bwd_bytes = allgather_bytes(pb)
    link = phase_link([list(range(P))], hw, p2p=False)
    merge = n_q * MERGE_BYTES / hw.mem_bw
    cf, cb = F / hw.fwd_tflops, B / hw.bwd_tflops
    fwd = max(link.t(fwd_bytes), cf / P) + cf * (P - 1) / P + (P - 1) * merge
    adds = (n_q + 2 * n_kv) * ADD_BYTES / hw.mem_bw
    bwd = max(link.t(fwd_bytes), cb / P) + cb * (P - 1) / P + P * adds + link.t(bwd_bytes - fwd_bytes)
    return Prediction(algo, fwd, bwd, fwd_bytes, bwd_bytes, F, B)


def _heads_cost(algo: str, pb: Problem, hw, R: int, U: int, grid, rank: int | None) -> Prediction:
    if not heads_allow(pb.heads, pb.kv_heads, U):
        return _infeasible(algo, pb, grid)
    s, n_q, _, _, e, acc = _sizes(pb)
    F, B = attention_flops(pb)
    fwd_bytes, bwd_bytes = ulysses_bytes(pb, U, rank)
    k = _kv_counts(pb, U)
    k_u = max(k)                                                            # the ring's largest K, V
    q_chunk = (U - 1) * pb.batch * s * pb.head_dim * e * pb.heads // U       # Q (or O, dO, dQ) one way
    # K, V (or dK, dV): the busiest member's, sent or received (K - k_j out and (U - 1) k_j in, or the reverse)
    kv_chunk = pb.batch * s * pb.head_dim * e * 2 * max(max(sum(k) - x, (U - 1) * x) for x in k)
    ta = lambda n: a2a_time(n, U, hw)  # noqa: E731
    if R == 1:                  # ulysses: C head chunks, each chunk's all-to-all in while the one before attends
        from ..algos.ulysses import chunk_count  # noqa: PLC0415
        C = chunk_count(pb.heads, pb.kv_heads, U, (n_q + 2 * pb.batch * s * pb.kv_heads * pb.head_dim) * e)
        fwd = pipelined(C, ta((q_chunk + kv_chunk) / C), F / hw.fwd_tflops / C, ta(q_chunk / C))
        bwd = pipelined(C, ta(q_chunk / C), B / hw.bwd_tflops / C, ta((q_chunk + kv_chunk) / C))
        return Prediction(algo, fwd, bwd, fwd_bytes, bwd_bytes, F, B, grid)
    # The ring across the groups on the head-sharded tensors, timed as ring.py's (model.ring_family_cost).
    cols = [[i * U + j for i in range(R)] for j in range(U)]
    link = phase_link(cols, hw, p2p=True)
    n_kv = pb.batch * U * s * k_u * pb.head_dim
    cf, cb = F / R / hw.fwd_tflops, B / R / hw.bwd_tflops
    merge = n_q * MERGE_BYTES / hw.mem_bw
    ring_f = overlapped([cf] + [cf + merge] * (R - 2), [link.t(2 * n_kv * e)] * (R - 1)) + cf + merge
    adds = (n_q + 2 * n_kv) * ADD_BYTES / hw.mem_bw
    m_blk, m_acc = 2 * n_kv * e, 2 * n_kv * (acc if pb.fp32_one_hop else wire_bytes(R - 1, e, acc))
    comm = [link.t(m_blk + (m_acc if i >= 2 else 0), 2 if i >= 2 else 1) for i in range(R - 1)]
    ring_b = overlapped([cb + adds] * (R - 1), comm) + max(cb + adds, link.t(m_acc) if R > 2 else 0.0) + link.t(m_acc)
    fwd = ta(q_chunk + kv_chunk) + ring_f + ta(q_chunk)
    bwd = ta(q_chunk) + ring_b + ta(q_chunk + kv_chunk)
    return Prediction(algo, fwd, bwd, fwd_bytes, bwd_bytes, F, B, grid)


def pipelined(chunks: int, t_in: float, t_compute: float, t_out: float) -> float:
    """Seconds of `chunks` (all-to-all in, compute, all-to-all out) stages, every in posted at once and each out
    as its compute ends, on one communication stream (in order: the ins, then the outs) beside the compute
    stream (ulysses' head chunks); 1 chunk: the three one after the other."""
    comm, ins = 0.0, []
    for _ in range(chunks):
        comm += t_in
        ins.append(comm)
    done = 0.0
    for arrived in ins:
        done = max(done, arrived) + t_compute
        comm = max(comm, done) + t_out
    return comm


def ulysses_cost(algo: str, pb: Problem, hw, rank: int | None = None) -> Prediction:
    """Two all-to-alls each way around one local attention over the whole sequence (h / P heads)."""
    return _heads_cost(algo, pb, hw, 1, pb.world, None, rank)


def ulysses_ring_cost(algo: str, pb: Problem, hw, rank: int | None = None) -> Prediction:
    """The all-to-alls inside grid rows of U consecutive ranks, ring.py's ring over the R rows between them."""
    R, U = ulysses_grid(pb)
    return _heads_cost(algo, pb, hw, R, U, (R, U), rank)
