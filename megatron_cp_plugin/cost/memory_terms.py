"""The memory planner's per-algorithm and per-layout terms, and the moments of a step they add up in (the peak of
cost/memory.py is the largest moment).

Attention (per rank, one layer, one micro-batch; t = micro-batch x S / P tokens, a query heads, g K, V heads, head
dim d, element size e, grid R x C): Q = t a d e and K = t g d e (q's and one of k, v's bytes), L = 4 a t (fp32 lse
or D rows), Qa = 4 t a d and Ka = 4 t g d (fp32 accumulators of q's and k's shape), G = Q + 2K (one backward call's
dq, dk, dv), ws = Qa (+ 2Q with GQA) (the fused backward kernel's workspace: cuDNN's and FA2's fp32 dQ accumulator,
and dK, dV expanded to every q head), blk = 2G + ws (around a backward call: the last call's gradients, this one's,
ws). Each algorithm has three terms, read from its code in algos/ (the same buffers as cp_attention.attention_need,
whose count was 0.95-1.36x the measured peak of every algorithm on an H200 at 128k; no MARGIN here: the planner's
--headroom is the slack):
  saved     what its autograd Function keeps beyond what the layer formula (plan.Model) counts, the zigzag
            algorithms' (q, k, v, o, lse): 0 for those, negative where the saved set replaces the fused QKV output
            (kept alive by the view v) and the rotated q, k (to the byte in CPU processes of the trainer;
            GPT-3 2.7B at 64k, CP = 2, ZeRO-1, whose peak is the loss: planned 121.3 / 126.3 / 131.3 GiB for
            attention2d-o / ulysses / ring, measured on H200s 121 / 126 / 131)
  forward   its buffers at the peak of its forward, beyond q, k, v and the output o
  backward  its buffers at the peak of its backward, beyond q, k, v, dO and its saved tensors (the returned dq,
            dk, dv included)
On one rank (P = 1) every algorithm runs one local block: `single`.

Megatron-FSDP 0.16.1 with optim_grads_params (megatron_fsdp.py, param_and_grad_buffer.py): one unit per
TransformerLayer of L parameters; its communication unit is U = max(1e9, 2L) elements; before a unit runs its
bf16 weights are gathered and the next units prefetched until the prefetch reaches U / 2 elements; a layer's
gradients are gathered in an unsharded fp32 bucket that waits in the reduce-scatter queue, which is trimmed to
U elements before the next bucket joins it and freed only when it leaves the queue (tests/test_plan.py checks
both counts).

The optimizer step: Megatron falls back to torch's Adam where neither TransformerEngine nor Apex is installed
(the GPU machine of these measurements); on CUDA it runs the foreach implementation (Megatron-FSDP's DTensors
too: torch.distributed.tensor adds DTensor to its foreach types), whose exp_avg_sq_sqrt is one fp32 tensor per
parameter it steps, alive at once. A CPU process of the trainer with foreach switched on measured exactly that
(4 bytes x the rank's shard) on top of the static bytes, for ZeRO-1 and ZeRO-3.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .. import cp_grid
from ..algos.allgather import GROUPED_MIN_P
from ..algos.ring import round_size
from ..cp_grid import group_chunks

FSDP_MIN_UNIT = 1_000_000_000
"""Megatron-FSDP's smallest communication unit in elements (megatron_fsdp.py: max(1e9, 2 x a unit's elements))."""


@dataclass(frozen=True)
class Shape:
    """One rank's attention of one layer and micro-batch."""

    tokens: int
    """t: micro-batch x S / P."""
    heads: int
    """a: query heads."""
    groups: int
    """g: K, V heads."""
    head_dim: int
    """d."""
    elem: int
    """e: bytes of q, k, v (2: bf16, 4: fp32)."""
    cp: int
    """P: ranks in context parallelism."""
    grid: tuple[int, int] = (1, 1)
    """(R, C) of a grid algorithm (Attention2D's rows x cols; ulysses-ring's rings x all-to-all size), else (1, 1)."""
    group_tokens: int | None = None
    """Attention2D's cap on the query tokens of one grouped kernel call (cp_grid.GROUP_TOKENS; None: its default rule)."""

    @property
    def Q(self) -> int:
        return self.tokens * self.heads * self.head_dim * self.elem

    @property
    def K(self) -> int:
        return self.tokens * self.groups * self.head_dim * self.elem

    @property
    def L(self) -> int:
        return 4 * self.heads * self.tokens

    @property
    def Qa(self) -> int:
        return 4 * self.tokens * self.heads * self.head_dim

    @property
    def Ka(self) -> int:
        return 4 * self.tokens * self.groups * self.head_dim

    @property
    def G(self) -> int:
        return self.Q + 2 * self.K

    @property
    def ws(self) -> int:
        return self.Qa + (2 * self.Q if self.groups < self.heads else 0)

    @property
    def blk(self) -> int:
        return 2 * self.G + self.ws


@dataclass(frozen=True)
class Terms:
    """An algorithm's bytes beyond what plan.Model's layer formula and the layer's own tensors count."""

    saved: int
    """Kept for the backward beyond the zigzag algorithms' (q, k, v, o, lse); negative where it keeps less."""
    forward: int
    """Its buffers at its forward's peak, beyond q, k, v and the output o."""
    backward: int
    """Its buffers at its backward's peak, beyond q, k, v, dO and the saved tensors."""


def single(sh: Shape) -> Terms:
    """One rank (P = 1): one local block. forward: the kernel's output and its fp32 copy (Qa + Q; ring.py's step 0);
    backward: blk, the fp32 dq, dk, dv accumulators (Qa + 2Ka)."""
    return Terms(0, sh.Qa + sh.Q, sh.blk + sh.Qa + 2 * sh.Ka)


def ring(sh: Shape) -> Terms:
    """ring.py (and ring-te). saved: (q, k, v, o, lse), 0. forward: K, V in hand and in flight (4K: `nxt =
    ring.send_recv(kv)`), the fp32 o and merge_'s fp32 cast of o_blk (2Qa), o_blk (Q). backward: the fp32 dq (Qa),
    K, V in hand and in flight (4K), the fp32 dK, dV accumulators own, in hand and arriving (6Ka: dk_own,
    dk_acc, dkv_in; at P = 2, one hop, the two travelling ones in the input dtype: 2Ka + 4K), blk.
    In rounds of g ranks (ring.round_size > 1; micro-batch 1, where the chunks sent and a call's keys are views):
    a round's K, V in hand and the next one's in flight (4gK); backward the fp32 dq, dk, dv (Qa + 2Ka), this round's
    partials and the last round's sent and arriving (6gK: in the input dtype, ring._backward_rounds), and around a
    call over up to g ranks' keys the last call's gradients and its own (2(Q + 2gK)) with ws."""
    g = round_size(sh.cp, sh.tokens)
    if g > 1:
        return Terms(0, 2 * sh.Qa + 4 * g * sh.K + sh.Q,
                     4 * g * sh.K + sh.Qa + 2 * sh.Ka + 6 * g * sh.K + 2 * (sh.Q + 2 * g * sh.K) + sh.ws)
    travel = 4 * sh.K if sh.cp == 2 else 4 * sh.Ka
    return Terms(0, 2 * sh.Qa + 4 * sh.K + sh.Q, sh.Qa + 4 * sh.K + 2 * sh.Ka + travel + sh.blk)


def burst(sh: Shape) -> Terms:
    """burst.py: ring's forward (`ring_forward`). backward: D (L, `attention_delta`), (Q, dO, D, lse) in hand and in
    flight (P > 2: 4Q + 4L; P = 2: the one in flight, 2Q + 2L), the fp32 dQ accumulators own, in hand and
    arriving (3Qa; at P = 2, one hop, the one in hand also cast and the arriving one in the input dtype: 2Qa + 2Q),
    dK, dV (2Ka), the surrogate O (Q, built through up to 3Qa of fp32 temporaries, or blk while a
    call runs) and the returned G. In rounds (ring.round_size > 1, micro-batch 1): below."""
    g = round_size(sh.cp, sh.tokens)
    if g > 1:
        # rounds: D and the copied D, lse chunks (3L); a round's (Q, dO, D, lse) in hand and the next in flight
        # (4g(Q + L)); fp32 dq, dk, dv (Qa + 2Ka); this round's dQ partials and the last one's sent and arriving, in
        # the input dtype (3gQ); around a call over g ranks' query chunks: the surrogate O (gQ), the D, lse runs
        # (2gL), the last call's gradients and its own (2(gQ + 2K)) and the kernel's workspace (g ws); the returned G
        call = g * sh.Q + 2 * g * sh.L + 2 * (g * sh.Q + 2 * sh.K) + g * sh.ws
        return Terms(0, ring(sh).forward, 3 * sh.L + 4 * g * (sh.Q + sh.L) + sh.Qa + 2 * sh.Ka + 3 * g * sh.Q
                     + call + sh.G)
    travel = 4 * sh.Q + 4 * sh.L if sh.cp > 2 else 2 * sh.Q + 2 * sh.L
    dq = 3 * sh.Qa if sh.cp > 2 else 2 * sh.Qa + 2 * sh.Q
    return Terms(0, ring(sh).forward,
                 travel + sh.L + dq + 2 * sh.Ka + sh.Q + max(3 * sh.Qa, sh.blk) + sh.G)


def allgather(sh: Shape) -> Terms:
    """allgather.py. forward: torch.stack([k, v]) (2K), the gathered K, V of every rank (2PK), the fp32 o and
    merge cast (2Qa), o_blk (Q). backward: K, V gathered again (2PK), the fp32 dK, dV partial of every owner
    (2PKa: `dkv_part`), the fp32 dq (Qa), then the largest of blk, reduce_at_owner (its cast, packed bytes and
    output: up to 8PK; or the fp32 sum: 2PK + 2PKa + 2Ka) and the results (2Ka + G).
    Grouped calls (P >= allgather.GROUPED_MIN_P): no stack (the chunks are gathered as they are); a call's keys
    span up to (P - 1) / 2 shards, so its K, V copies (at micro-batch > 1; views at 1, counted anyway) are up to
    (P - 1)K, and around a backward call the last call's and this one's gradients 2(Q + (P - 1)K) with ws."""
    P, K, Ka = sh.cp, sh.K, sh.Ka
    reduce = max(8 * P * K, 2 * P * K + 2 * P * Ka + 2 * Ka)
    if P >= GROUPED_MIN_P:
        keys = (P - 1) * K
        call = 2 * (sh.Q + keys) + sh.ws + keys
        return Terms(0, 2 * P * K + 2 * sh.Qa + sh.Q + keys,
                     2 * P * K + 2 * P * Ka + sh.Qa + max(call, reduce, 2 * Ka + sh.G))
    return Terms(0, 2 * K + 2 * P * K + 2 * sh.Qa + sh.Q,
                 2 * P * K + 2 * P * Ka + sh.Qa + max(sh.blk, reduce, 2 * Ka + sh.G))


def kv_heads_read(heads: int, groups: int, size: int) -> int:
    """The most K, V heads one member of an all-to-all over `size` ranks reads (ulysses.kv_spans: q heads
    u h/size .. (u + 1) h/size - 1 read K, V heads i // (h / h_kv))."""
    hu, grp = max(heads // size, 1), max(heads // groups, 1)
    return max(((u + 1) * hu - 1) // grp + 1 - u * hu // grp for u in range(size))


def ulysses(sh: Shape) -> Terms:
    """ulysses.py (grid (1, P)) and ulysses-ring (grid (R, U)): Kh = t U k_U d e, the K or V heads one member
    receives (k_U = kv_heads_read), heads = Q + 2Kh (q_h, k_h, v_h). saved: (q_h, k_h, v_h, o_h, lse) in place of
    the fused QKV output and the rotated q, k: (2U k_U - 3g) d e per token (-g d e where U k_U = g). forward:
    the head-sharded q, k, v, then each all-to-all's packing, output, reshape and reorder copies (4 x heads) or
    ring's forward on the head shards (R > 1) or the output's (6Q). backward: the largest of the output
    all-to-all (5Q), the local backward (Q + heads + ws, plus ring's backward on the head shards for R > 1) and
    the gradients' all-to-all (5 x heads + 2Ka: their rows written straight into the send buffer,
    `ulysses._scatter_rows`). The causal zigzag forward by halves (`_ulysses_halves`) is counted as this: its two
    halves' buffers, the second half's fp32 output and the concatenated saves stay within the packing's 4 x heads
    (its backward is this one). It saves what this path saves (tests/test_plan.py checks that term); its transient
    peak is not measured."""
    R, U = sh.grid
    k_u = kv_heads_read(sh.heads, sh.groups, U)
    Kh = sh.tokens * U * k_u * sh.head_dim * sh.elem
    Kha = Kh // sh.elem * 4
    heads = sh.Q + 2 * Kh
    ring_f = 2 * sh.Qa + 4 * Kh + 2 * sh.Q if R > 1 else sh.Q
    ring_b = sh.Qa + 4 * Kh + 6 * Kha + heads if R > 1 else 0
    saved = (2 * U * k_u - 3 * sh.groups) * sh.head_dim * sh.elem * sh.tokens
    return Terms(saved, heads + max(4 * heads, ring_f, 6 * sh.Q) - sh.Q,
                 max(5 * sh.Q, sh.Q + heads + sh.ws + ring_b, 5 * heads + 2 * sh.Ka))


def attention2d_no(sh: Shape) -> Terms:
    """attention2d.py. saved: (q, row-major K, V stacked, o, lse): 2K for the fused QKV output and the rotated k,
    -(a + g) d e per token. Its kernel calls take n chunks of Q and of K, V at once (cp_grid.group_chunks, the
    column-major placement's; the node-aware placement's n = 1 is counted as that: an over-count there). forward:
    the stacked K, V (2K), Q gathered in the row (gq = CQ, none at C = 1), K, V in the column (gkv = 2RK, none at
    R = 1), each replaced by its interleaved groups (n > 1: the larger one beside its copy, max(gq, gkv)), the fp32
    partials o_part, lse_part (C (Qa + L)), then a call's output and its cast (n (2Q + Qa)) or AttnFix's all-to-all
    (its send and receive buffers, 2C (Qa + L)). backward: lse (L), Q, dO gathered (2gq), D, lse gathered (2CL),
    K, V (gkv), the fp32 dQ and dK, dV partials (C Qa + 2R Ka), then the largest of the calls (n (Q + max(3Qa,
    blk + G))), the dq sum in the row (2C Qa + Qa), the dK, dV sum in the column (its cast and receive buffer 4RK,
    or the fp32 sum 2RK + 2Ka) and the results (Qa + 2Ka + 4K + G); on R x 1 (attention2d.own_split) the
    exchange's buffers (4RK) beside the own pair's last call, which runs while it travels (packed documents do not
    split: an over-count there)."""
    R, C = sh.grid
    n = group_chunks(R, C, sh.tokens, sh.group_tokens)
    Q, K, L, Qa, Ka = sh.Q, sh.K, sh.L, sh.Qa, sh.Ka
    gq, gkv = (C * Q if C > 1 else 0), (2 * R * K if R > 1 else 0)
    saved = -(sh.heads + sh.groups) * sh.head_dim * sh.elem * sh.tokens
    fwd = 2 * K + gq + gkv + max(max(gq, gkv) if n > 1 else 0,
                                 C * (Qa + L) + max(n * (2 * Q + Qa), 2 * C * (Qa + L) if C > 1 else 0))
    bwd = (L + 2 * gq + 2 * C * L + gkv + C * Qa + 2 * R * Ka
           + max(n * (Q + max(3 * Qa, sh.blk + sh.G)),
                 2 * C * Qa + Qa if C > 1 else 0,
                 (Qa if C > 1 else 0) + max(4 * R * K, 2 * R * K + 2 * Ka) if R > 1 else 0,
                 4 * R * K + Q + max(3 * Qa, sh.blk + sh.G) if C == 1 and R > 1 else 0,
                 Qa + 2 * Ka + 4 * K + sh.G))
    return Terms(saved, fwd, bwd)


def attention2d_o(sh: Shape) -> Terms:
    """attention2d_o.py. saved: as attention2d-no. forward: the column's K, V chunks (2RK), Q blocks in flight (and
    in hand, C > 2: qn Q), the fp32 o accumulators own, in hand, arriving, sent (no (Qa + L), C = 1: one), the
    kernel's output and cast (Q + Qa). backward: (Q, dO, D, lse) in flight (qn (2Q + 2L)), D (L), the other rows'
    K, V (2(R - 1)K), dK, dV partials (2R Ka), the dQ accumulators (nq Qa), the travelling dK, dV (R = 2: 4K in
    the input dtype, else 4Ka), then the block loop (Q + max(3Qa, blk + G)) or the results (2Ka + 4K + Q).
    Batched passes (m = the chunks a call takes, `attention2d_o.batch_cap`; m > 1 only where chunks are small): the
    column's chunks stacked beside the received ones while they are copied (2RK), a call's repeated Q block and its
    output and lse (m (2Q + L)) forward; backward its repeated Q, dO, O and lse and its gradients (m (4Q + 2K + L))
    and the dQ sum (Qa). Shards that `cp_grid.overlap_pays` does not take run Attention2D-NO: its terms."""
    if not cp_grid.overlap_pays(sh.tokens):
        return attention2d_no(sh)
    R, C = sh.grid
    Q, K, L, Qa, Ka = sh.Q, sh.K, sh.L, sh.Qa, sh.Ka
    qn = 0 if C == 1 else 1 if C == 2 else 2
    no = 1 if C == 1 else 3 if C == 2 else 4
    nq = 1 if C == 1 else 3 if C == 2 else 4
    m = cp_grid.batch_chunks(R, sh.tokens, sh.group_tokens) if R > 1 and C > 1 else 1
    stack = 2 * R * K if m > 1 else 0
    travel = 0 if R == 1 else 4 * K if R == 2 else 4 * Ka
    fwd = 2 * R * K + qn * Q + no * (Qa + L) + max(Q + Qa, stack + m * (2 * Q + L))
    batched = stack + m * (4 * Q + 2 * K + L) + Qa if m > 1 and C > 2 else 0
    bwd = (qn * (2 * Q + 2 * L) + L + 2 * (R - 1) * K + 2 * R * Ka + nq * Qa + travel
           + max(Q + max(3 * Qa, sh.blk + sh.G), 2 * Ka + 4 * K + Q, batched))
    return Terms(attention2d_no(sh).saved, fwd, bwd)


TERMS = {"ring": ring, "ring-te": ring, "burst": burst, "allgather": allgather, "ulysses": ulysses,
         "ulysses-ring": ulysses, "attention2d-no": attention2d_no, "attention2d-o": attention2d_o}
"""Algorithm -> its terms. An algorithm registered without an entry here (registry.register at run time) is
planned with the ring's terms, the zigzag p2p baseline's."""


def algorithms(flag: str, heads: int, cp: int, grid_given: bool = False) -> tuple[str, ...]:
    """The algorithms a --context-parallel-algo value may run on cp ranks: itself, or for auto and a family every
    candidate the cost model chooses among (registry.candidates; ulysses only where its all-to-all can split the
    heads), of which the planner takes the largest peak: the plan holds whichever the cost model picks."""
    from ..algos import registry
    if flag in registry.names(baselines=True):
        return (flag,)
    return tuple(a for a in registry.candidates(flag, grid_given) if a != "ulysses" or heads % cp == 0)


def grid_of(algo: str, cp: int, heads: int, groups: int, grid: tuple[int, int] | None) -> tuple[int, int]:
    """(R, C) of `algo` on cp ranks: --cp-grid where it has cp ranks, else the registry's default (Attention2D's
    cp_grid.choose_grid, ulysses-ring's default_grid); ulysses: one all-to-all (1, P); others (1, 1)."""
    from ..algos import registry
    if algo == "ulysses":
        return 1, cp
    row = registry.get(algo)
    if not row.grid:
        return 1, 1
    if grid is not None and grid[0] * grid[1] == cp:
        return tuple(grid)
    return row.grid_shape(cp, heads, groups)


def terms(algo: str, sh: Shape) -> Terms:
    """`algo`'s terms on `sh` (P = 1: `single`)."""
    if sh.cp == 1:
        return single(sh)
    return TERMS.get(algo, ring)(sh)


# ----------------------------------------------------------------------------------------------- Megatron-FSDP
def fsdp_unit(layer_params: int) -> int:
    """Megatron-FSDP's communication unit in elements for ZeRO-3 units of `layer_params` parameters."""
    return max(FSDP_MIN_UNIT, 2 * layer_params)


def fsdp_gathered_layers(layer_params: int) -> int:
    """Layers whose bf16 weights are gathered at once: the running one and those prefetched until the prefetch
    reaches U / 2 elements (AllGatherPipeline.all_gather_params): GPT-3 13B (L = 314.6M) 3, 2.7B 8, 760M 19."""
    return 1 + math.ceil(fsdp_unit(layer_params) // 2 / layer_params)


def fsdp_queued_grads(layer_params: int) -> int:
    """Layers whose unsharded fp32 gradients wait in the reduce-scatter queue while the next layer's are made: the
    queue is trimmed while it holds more than U elements, then the last layer joins it
    (GradReducePipeline.reduce_gradients). A bucket is padded a little beyond L (12,594,176 -> 12,599,296 in a
    CPU run of the trainer), so U / L buckets already exceed U when that is a whole number: ceil(U / L) in all.
    13B 4, 2.7B 13, 175B (U = 2L) 2; a CPU run with U = 3.18L queued 4, with U = 2L 2."""
    return math.ceil(fsdp_unit(layer_params) / layer_params)


def fused_adam_for(layout, fused_adam: bool | None) -> bool:
    """Whether `layout`'s optimizer step is fused: `fused_adam` where given, else megatron-cp-pretrain's on GPUs:
    torch's fused Adam for DDP and ZeRO-1 (plain tensors: megatron/compat.use_fused_adam), foreach under
    Megatron-FSDP (DTensors) and in pipeline layouts (Megatron-LM's runs)."""
    if fused_adam is not None:
        return fused_adam
    return layout.pp == 1 and layout.zero in ("ddp", "zero1")


def adam_step_bytes(stepped_params: float, fused: bool) -> float:
    """The optimizer step's temporaries: torch's foreach Adam keeps one fp32 exp_avg_sq_sqrt per parameter it steps
    (4 bytes each); TransformerEngine's or Apex's FusedAdam none."""
    return 0.0 if fused else 4.0 * stepped_params


# ----------------------------------------------------------------------------------------------- a step's moments
@dataclass(frozen=True)
class LayerBytes:
    """One layer's bytes on one GPU for one micro-batch under a layout and CP algorithm."""

    attn: Shape
    """The attention's shape on this GPU."""
    terms: Terms
    """The algorithm's terms (`terms`)."""
    running: float
    """What the layer holds while its attention runs (the formula's tensors: q, k, v still alive)."""
    act: float
    """What it keeps for its backward once its attention has run (the formula + the algorithm's `saved`)."""
    kept: float
    """What it keeps between its forward and its backward: act, or its input with full recompute."""
    mlp: float
    """The MLP's share of act: the FC1 and second norm inputs, the FC1 and GeLU outputs (freed in its backward)."""


def layer_bytes(m, layout, cp: int, algo: str) -> LayerBytes:
    """One layer of plan.Model m under plan.Layout layout on cp GPUs in context parallelism, `algo` attending."""
    t = m.micro_batch * m.seq // cp
    grid = grid_of(algo, cp, m.heads, m.groups, m.grid) if cp > 1 else (1, 1)
    sh = Shape(t, m.heads, m.groups, m.head_dim, m.elem, cp, grid, m.group_tokens)
    at = terms(algo, sh)
    running = m.layer_activation_bytes_per_token() * t
    act = running + at.saved
    # full recompute keeps each layer's input; offloaded (training/offload.py) it waits in host memory, and the
    # moments' running layer holds the one in use (its copy back in the backward)
    kept = 0.0 if layout.offload else m.elem * m.hidden * t if layout.recompute else act
    return LayerBytes(sh, at, running, act, kept, (m.elem * (2 * m.hidden + 2 * m.ffn) + 4) * t)


def moments(m, layout, lb: LayerBytes, params: float, root: float, layers: int, in_flight: int,
            has_loss: bool, fused_adam: bool | None = None) -> dict[str, float]:
    """Bytes beyond the static ones at each moment of a step (cost/memory.py's module docstring) on one stage of
    `layers` layers with `in_flight` micro-batches kept and `params` parameters, `root` of them the root unit's."""
    cp, t = lb.attn.cp, lb.attn.tokens
    h, e, f, L = m.hidden, m.elem, m.ffn, m.layer_params
    at, kept = lb.terms, lb.kept
    n = in_flight * layers                                    # layers kept when the backward starts
    zero3, zero2 = layout.zero == "fsdp-optim_grads_params", layout.zero == "fsdp-optim_grads"
    ng, nq = fsdp_gathered_layers(L), fsdp_queued_grads(L)
    wgrad = e * h * f     # the largest weight's bf16 gradient, until its hook adds it to the fp32 buffer or bucket
    out = {}
    if has_loss:                                              # the fp32 softmax (in final) and the bf16 logits
        out["loss"] = n * kept + m.final_activation_bytes_per_token() * t + e * m.vocab * t + (e * root if zero3
                                                                                               else 0.0)
    out["forward"] = 0.0
    for i in range(layers):                                   # layer i's attention, i layers kept before it
        gathered = e * (root + min(ng, layers - i) * L) if zero3 else 0.0
        before = ((in_flight - 1) * layers + i) * kept
        out["forward"] = max(out["forward"], before + lb.running - lb.mlp + at.forward + gathered)
    out["backward"] = 0.0
    for j in range(layers):                                   # the j-th layer from the top
        others = (n - 1 - j) * kept                           # the layers not yet done, the running one aside
        fsdp = 4.0 * (root + L) if zero2 else 0.0             # ZeRO-2: one layer's and the root's fp32 gradients
        if zero3:
            # gathered weights; the root's unsharded fp32 bucket (made at the output layer's gradient, reduced after
            # the embedding's); the queued layers' and, from its first weight gradient on, the running layer's
            fsdp = e * (root + min(ng, layers - j) * L) + 4.0 * root + 4.0 * L * (min(j, nq) + 1)
            # its last gradient launches its reduce-scatter: the output shard, the layer's tensors freed
            out["backward"] = max(out["backward"], others + e * h * t + fsdp + 4.0 * L / cp)
        recomputed = others + e * h * t + lb.running - lb.mlp + at.forward if layout.recompute else 0.0
        mlp_bwd = others + lb.act + e * h * t + 2 * e * f * t + wgrad           # + the FC1, GeLU output grads
        attn_bwd = others + lb.act - lb.mlp + e * h * t + lb.attn.Q + at.backward + wgrad   # + dO
        out["backward"] = max(out["backward"], fsdp + max(recomputed, mlp_bwd, attn_bwd))
    if zero3:          # after the last layer: the root's weights, its fp32 bucket, the embedding's gradient, the queue
        out["end"] = e * root + 4.0 * root + e * m.vocab * h + 4.0 * L * min(layers, nq)
    # ZeRO-3: the root unit's gathered bf16 weights stay through the step on newer megatron-core (0.19.2 marks the
    # root bucket preserved; 0.16.1 frees it and gathers it again after the step): counted, at most 1 GiB (13B)
    out["step"] = adam_step_bytes(params if layout.zero == "ddp" else params / cp,
                                  fused_adam_for(layout, fused_adam)) + (e * root if zero3 else 0.0)
    return out
