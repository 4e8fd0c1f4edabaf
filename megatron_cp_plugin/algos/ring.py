"""Ring attention over the zigzag layout: the baseline, equivalent to TransformerEngine's `cp_comm_type=p2p`.

Forward: K, V travel the ring; each step's block result merges into the running (o, lse) by online softmax
(this is also BurstAttention's forward, Alg. 1 of burst-attention.txt, which `burst.py` reuses).
Backward: K, V travel the ring again, and the dK, dV accumulators of each K, V block travel with it one step
behind, ending on their owner. The next step's send/recv is posted before the current block's compute so the
two overlap on GPU. Packed sequences (cu_seqlens): each step is the varlen calls of `_zigzag.zigzag_blocks`.
Short shards (under ROUND_MAX_LOCAL, from ROUND_MIN_P ranks on) run in rounds (`round_size`): a rank meets the K, V of
g ranks per round in at most three kernel calls, each rank sending its own K, V straight to the next g and each
dK, dV partial straight to its owner; g times fewer calls, and each partial, one kernel call's result summed once at
its owner, travels in the input dtype (the one-hop rule; what a GPU's fused kernels return): ring = ring-te there.

Bytes sent per rank and call (e = element size, n_kv = b * s_local * h_kv * d, acc = 4, or 8 for fp64):
  forward  (P - 1) * 2 * n_kv * e                       (K, V)
  backward (P - 1) * 2 * n_kv * (e + acc)               (K, V; dK, dV accumulated in fp32)
           (P - 1) * 2 * n_kv * 2e                      in rounds (g > 1), and at P = 2
The dK, dV accumulators are summed into at every hop, so they travel in fp32 (the wire-precision policy,
docs/design.md); in rounds nothing is summed on the way, and at P = 2 an accumulator makes one hop, so they travel in
the input dtype (RoundPartials; `comm.wire_dtype`).
`ring-te` is the same ring with TransformerEngine's p2p byte budget, the baseline users compare against: the
travelling dK, dV in the input dtype, rounded at every hop, backward (P - 1) * 2 * n_kv * 2e.
"""
from __future__ import annotations

import torch

from ..comm import CommStats, Exchange, Ring, group_size, wire_dtype
from ..kernels.local_attn import acc_dtype, block_bwd, block_fwd
from ..kernels.merge import accumulate_, merge_
from ._function import CPAttention, in_zigzag_order, saving_inputs
from ._zigzag import ALL, chunk_run, put_run_, zigzag_blocks

ROUND_TOKENS = 32768
"""Keys a round's calls should meet: a round takes g = ceil(ROUND_TOKENS / s_local) ranks (`round_size`).
Why 32k: at 128k causal on one H100 (issue 34, replayed ranks, the slowest of three, fwd+bwd ms, MHA 32/32 and GQA
32/8; `neighbour` is the ring of one call a step):
    P = 64 (2k a rank): neighbour 44.4 / 30.3, g = 8 35.5 / 23.1, g = 16 28.8 / 20.6, g = 32 29.3 / 20.6
    P = 32 (4k):        neighbour 42.6 / 37.2, g = 4 43.4 / 35.0, g = 8 41.3 / 33.1, g = 16 40.4 / 32.9
    P = 16 (8k):        neighbour 67.8 / 63.9, g = 2 73.4 / 64.2, g = 4 69.4 / 60.3, g = 8 67.7 / 58.7
Larger rounds gain little past 32k keys and hold more in flight: a round's K, V (two rounds: the next is posted
before this one's compute) and, in the backward, its fp32 dK, dV partials (cost/memory_terms.py)."""
ROUND_MAX_LOCAL = 16384
"""Shards of this many tokens or more run the neighbour ring: at 64k tokens a rank (1M over P = 16) one call a step
ran at 0.96-0.98x the ideal, at 16k (1M over P = 64) at 1.02-1.07x (same H100 run); at 8k rounds of 2-4 ranks
were slower than the neighbour ring with MHA (above), rounds of 8 level with it."""
ROUND_MIN_P = 4
"""Rounds from this many ranks on: below it a round's calls (up to three) would outnumber the steps they replace."""
MAX_BATCH_MESSAGES = 256
"""Most point-to-point messages (sends and receives) in one `batch_isend_irecv`, i.e. one NCCL group: a round posts
its peers in batches of at most this many (`_batches`). Why: batches of ~1000 operations have hung in NCCL while
256 did not (pytorch/pytorch#174288, #174942, on 4 H100s). A round at P = 64 and 2k tokens a rank posts 128 (ring)
or 192 (burst), so nothing shipped is split below P = 128 (1k tokens a rank: rounds of 32 peers, 256 and 384)."""


def round_size(P: int, s_local: int, packing=None) -> int:
    """g, the ranks whose K, V one round meets: 1 (the neighbour ring, one block a step) for packed sequences, below
    ROUND_MIN_P and for shards of ROUND_MAX_LOCAL or more; else enough ranks for ROUND_TOKENS keys, at most P - 1.

    In rounds each rank sends its own K, V straight to the next g ranks and receives the previous g ranks' (one
    batch of messages, the next round's posted before this round's compute, as the ring posts its next hop): the
    bytes of the ring, in g-times fewer and larger kernel calls. The zigzag chunks of a round's ranks go in at
    most three calls, whatever g (`_round_calls`); the backward sends each dK, dV partial straight to its owner,
    which sums them in fp32 (each partial travels in the input dtype: `RoundPartials`)."""
    if packing is not None or P < ROUND_MIN_P or s_local >= ROUND_MAX_LOCAL:
        return 1
    return min(P - 1, -(-ROUND_TOKENS // max(1, s_local)))


def _chunks(k, v, causal: bool) -> tuple[list[slice], list]:
    """The rows a round sends of this rank's K, V, one message a chunk: causal, its two zigzag chunks apart, so
    that a round's first chunks are one run of keys; else the whole shard. Each chunk is K and V interleaved by
    token, [b, n, 2, h_kv, d] (flash-attn's kv-packed layout, cuDNN's "bs2hd"; `_kv` reads K and V back as views
    with a row stride of 2 h_kv d): one message a peer and chunk where K and V apart were two. At P = 64 (rounds
    of 16 peers) that is 1000 messages a fwd+bwd where there were 1512 (the dK, dV partials unchanged), each a
    `P2POp` posted from Python (docs/performance.md, twenty-first session)."""
    half = k.shape[1] // 2
    cuts = [slice(0, half), slice(half, None)] if causal else [ALL]
    return cuts, [torch.stack([k[:, c], v[:, c]], dim=2) for c in cuts]


def _kv(buf, sel: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [b, m' n, h_kv, d] of the ranks `sel` of a round's received chunks [m, b, n, 2, h_kv, d]: views at
    micro-batch 1 (`chunk_run`), last dim contiguous, as the kernels take them."""
    kv = chunk_run(buf, sel)
    return kv[:, :, 0], kv[:, :, 1]


def _batches(ex: Exchange, sends: list, recvs: list) -> None:
    """Post a round's (peer, tensors) sends and receives, entry i of both for dists[i], in batches of whole peers of
    at most MAX_BATCH_MESSAGES messages. Every rank cuts the same distances into the same batches, so a send to
    the rank d ahead and that rank's receive from d behind are always in the same NCCL group."""
    per_peer = len(sends[0][1]) + len(recvs[0][1]) if sends else 1
    step = max(1, MAX_BATCH_MESSAGES // per_peer)
    for i in range(0, len(sends), step):
        ex.post(sends[i:i + step], recvs[i:i + step])


def post_round(ex: Exchange, dists: list[int], mine: list) -> list:
    """Send `mine` to the ranks dists ahead, receive the same from the ranks dists behind: [len(dists), ...]
    buffers, one per tensor of mine, row i from the rank dists[i] behind."""
    P, r = ex.world, ex.rank
    bufs = [torch.empty((len(dists),) + tuple(t.shape), dtype=t.dtype, device=t.device) for t in mine]
    rows = [b.unbind(0) for b in bufs]                  # one call a tensor, not one view a peer (host time at P = 64)
    _batches(ex, [((r + d) % P, mine) for d in dists],
             [((r - d) % P, [x[i] for x in rows]) for i, d in enumerate(dists)])
    return bufs


def _round_calls(r: int, dists: list[int], s: int, causal: bool) -> list[tuple[slice, int, slice, str]]:
    """[(query rows, chunk part, round rows, mask)] of one round on rank r. A rank dists[i] behind is before r when
    dists[i] <= r (no wrap): every query row sees its first chunk; one after r shows both chunks to the second query
    chunk only (zigzag: rank i holds chunks i and 2P-1-i). dists increase, so each kind is a run of round rows."""
    m = len(dists)
    if not causal:
        return [(ALL, 0, slice(0, m), "none")]
    ne, late = n_before(r, dists), slice(s // 2, None)
    calls = [(ALL, 0, slice(0, ne), "none")] if ne else []
    if ne < m:
        calls += [(late, 0, slice(ne, m), "none"), (late, 1, slice(ne, m), "none")]
    return calls


class RoundPartials:
    """A round's partials for the m ranks it met, t tensors each (the ring's dK, dV; burst's dQ), of their chunks
    `cuts` of shard shape `shard`. Every chunk's rows are one kernel call's result (the calls meet disjoint rows), so
    a partial is summed once, at its owner, and travels in `dtype`, the input dtype (the wire-precision policy's
    one-hop rule). A GPU's fused kernels return dQ, dK, dV in the input dtype, rounded once inside (fp32 would carry
    the same values in twice the bytes, plus a cast pass: 3.8 ms of 29 at 128k P = 64 MHA on an H100, eleventh
    session's profile); the math backend's fp32 is rounded to it once. At micro-batch 1 a rank's rows of a call's
    run are contiguous, so they are sent as views of the call's output (no copy; a chunk no call met as zeros); at
    b > 1, or in another dtype than the kernel's (the math backend's), they are copied into one buffer
    (`put_run_`)."""

    def __init__(self, m: int, t: int, shard, cuts: list, dtype):
        self.m, self.t, self.shard, self.cuts, self.dtype = m, t, tuple(shard), cuts, dtype
        self.views = shard[0] == 1
        self.pieces = [[None] * (len(cuts) * t) for _ in range(m)]        # [row][c * t + j]
        self.part = None
        self.met = [set() for _ in cuts]                                  # rows of chunk c that a call met

    def put(self, sel: slice, c: int, grads) -> None:
        """The t gradients [b, len(sel) n, ...] of a call whose keys (or queries) were the chunks c of rows sel."""
        first = self.part is None and all(p is None for row in self.pieces for p in row)
        if first and grads[0].dtype != self.dtype:          # a cast either way: one buffer, one copy a call
            self.views = False
        if self.views:
            n = grads[0].shape[1] // (sel.stop - sel.start)
            for j, grad in enumerate(grads):
                for x, piece in zip(range(sel.start, sel.stop), grad.split(n, dim=1)):
                    self.pieces[x][c * self.t + j] = piece
            return
        if self.part is None:
            self.part = grads[0].new_empty((self.m, self.t) + self.shard, dtype=self.dtype)
        self.met[c].update(range(sel.start, sel.stop))
        for j, grad in enumerate(grads):
            put_run_(self.part[sel, j][:, :, self.cuts[c]], grad)

    def post_home(self, ex: Exchange, dists: list[int]) -> torch.Tensor:
        """Send row i (for the rank dists[i] behind) straight to its owner, receive this rank's from the ranks dists
        ahead: [m, t, *shard], read after ex.wait() (this object holds what it sends until then)."""
        P, r = ex.world, ex.rank
        if not self.views:
            part = self.part
            for c, cut in enumerate(self.cuts):                 # only the rows no call met are zeroed, run by run
                x = 0
                while x < self.m:
                    if x in self.met[c]:
                        x += 1
                        continue
                    end = next((y for y in range(x, self.m) if y in self.met[c]), self.m)
                    part[x:end, :, :, cut].zero_()
                    x = end
            back = torch.empty_like(part)
            self._sent = part
            _batches(ex, [((r - d) % P, [part[i]]) for i, d in enumerate(dists)],
                     [((r + d) % P, [back[i]]) for i, d in enumerate(dists)])
            return back
        like = next(p for row in self.pieces for p in row if p is not None)     # views: in self.dtype already
        zeros = {}
        sends = []
        for i, d in enumerate(dists):
            row = []
            for c, cut in enumerate(self.cuts):
                for j in range(self.t):
                    p = self.pieces[i][c * self.t + j]
                    if p is None:                                   # a chunk no call met: zeros, one per shape
                        shape = (self.shard[0], len(range(*cut.indices(self.shard[1])))) + self.shard[2:]
                        if shape not in zeros:
                            zeros[shape] = torch.zeros(shape, dtype=self.dtype, device=like.device)
                        p = zeros[shape]
                    row.append(p)
            sends.append(((r - d) % P, row))
        back = torch.empty((self.m, self.t) + self.shard, dtype=self.dtype, device=like.device)
        # row i's pieces, chunk by chunk: one unbind per (chunk, tensor), not two views per peer
        cols = [back[:, j, :, cut].unbind(0) for cut in self.cuts for j in range(self.t)]
        recvs = [((r + d) % P, [col[i] for col in cols]) for i, d in enumerate(dists)]
        self._sent = sends
        _batches(ex, sends, recvs)
        return back


def n_before(r: int, dists: list[int]) -> int:
    """How many of a round's ranks (dists behind r, increasing) come before rank r in the sequence: the first
    n_before rows of the round (causal: their second zigzag chunks meet none of r's queries, and r's second chunk
    none of theirs)."""
    return sum(d <= r for d in dists)


def round_distances(P: int, g: int) -> list[list[int]]:
    """The distances of each round: [1 .. g], [g + 1 .. 2g], ..., up to P - 1."""
    return [list(range(i, min(i + g, P))) for i in range(1, P, g)]


def _forward_rounds(group, q, k, v, *, causal, scale, backend, stats, g):
    """ring_forward in rounds of g ranks (round_size)."""
    ex = Exchange(group, "forward", stats)
    P, r, s = ex.world, ex.rank, q.shape[1]
    _, mine = _chunks(k, v, causal)
    rounds = round_distances(P, g)
    nxt = post_round(ex, rounds[0], mine)
    o, lse = block_fwd(q, k, v, mask="causal" if causal else "none", scale=scale, backend=backend)   # own block
    o = o.to(acc_dtype(q.dtype))
    for i, dists in enumerate(rounds):
        ex.wait()
        bufs = nxt
        if i + 1 < len(rounds):                                 # the next round's K, V travel during this compute
            nxt = post_round(ex, rounds[i + 1], mine)
        for qs, c, sel, mask in _round_calls(r, dists, s, causal):
            o_blk, lse_blk = block_fwd(q[:, qs], *_kv(bufs[c], sel), mask=mask, scale=scale, backend=backend)
            merge_(o[:, qs], lse[:, :, qs], o_blk, lse_blk)     # online-softmax merge (Alg. 1, lines 13-16)
    return o.to(q.dtype), lse


def _backward_rounds(group, do, q, k, v, o, lse, *, causal, scale, backend, stats, g):
    """The ring's backward in rounds of g ranks: K, V as in _forward_rounds; each round's dK, dV partials go straight
    to their owners (`RoundPartials`: in the input dtype, so ring and ring-te are one algorithm here), who sum them
    in fp32 with their own."""
    ex_kv, ex_d = Exchange(group, "backward", stats), Exchange(group, "backward", stats)
    P, r, s = ex_kv.world, ex_kv.rank, q.shape[1]
    acc = acc_dtype(q.dtype)
    cuts, mine = _chunks(k, v, causal)
    rounds = round_distances(P, g)
    nxt = post_round(ex_kv, rounds[0], mine)
    dq, dk, dv = (t.to(acc) for t in block_bwd(do, q, k, v, o, lse, mask="causal" if causal else "none",
                                                scale=scale, backend=backend))
    back = sent = None                                          # our partials from the last round's holders
    for i, dists in enumerate(rounds):
        ex_kv.wait()
        bufs = nxt
        if i + 1 < len(rounds):
            nxt = post_round(ex_kv, rounds[i + 1], mine)
        # the calls meet disjoint rows of the partials; only the second chunks of the ranks before r are not met
        part = RoundPartials(len(dists), 2, k.shape, cuts, k.dtype)
        for qs, c, sel, mask in _round_calls(r, dists, s, causal):
            dq_b, dk_b, dv_b = block_bwd(do[:, qs], q[:, qs], *_kv(bufs[c], sel), o[:, qs], lse[:, :, qs],
                                         mask=mask, scale=scale, backend=backend)
            dq[:, qs].add_(dq_b)
            part.put(sel, c, (dk_b, dv_b))                      # each source's rows of this call's keys
        if back is not None:
            ex_d.wait()
            dk += back[:, 0].sum(0, dtype=acc)
            dv += back[:, 1].sum(0, dtype=acc)
        back, sent = part.post_home(ex_d, dists), part          # `sent` holds the views until the wait
    ex_d.wait()
    dk += back[:, 0].sum(0, dtype=acc)
    dv += back[:, 1].sum(0, dtype=acc)
    del sent
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def ring_forward(group, q, k, v, *, causal, scale, backend, stats=None, packing=None):
    """q [b, s, h, d], k, v [b, s, h_kv, d] (zigzag shards) -> (o [b, s, h, d] in q.dtype, lse [b, h, s] fp32)."""
    g = round_size(group_size(group), q.shape[1], packing)
    if g > 1:
        return _forward_rounds(group, q, k, v, causal=causal, scale=scale, backend=backend, stats=stats, g=g)
    ring = Ring(group, "forward", stats)
    P, r, s = ring.world, ring.rank, q.shape[1]
    o = lse = None
    kv = (k, v)
    for step in range(P):
        # Post the next K, V transfer before this step's compute.
        if step + 1 < P:
            nxt = ring.send_recv(kv)
        src = (r - step) % P                                    # owner of the K, V block in hand
        for qs, ks, mask, seg in zigzag_blocks(r, src, s, causal, packing):
            o_blk, lse_blk = block_fwd(q[:, qs], kv[0][:, ks], kv[1][:, ks], mask=mask, scale=scale,
                                       backend=backend, cu_seqlens_q=seg)
            if o is None and qs == ALL:                         # step 0's one block covers every row
                o, lse = o_blk.to(acc_dtype(q.dtype)), lse_blk      # (the kernel's own lse: no copy)
                continue
            if o is None:                                       # packed: step 0 comes in pieces
                o = torch.zeros(q.shape, dtype=acc_dtype(q.dtype), device=q.device)
                lse = torch.full(lse_blk.shape[:2] + (s,), float("-inf"), dtype=o.dtype, device=q.device)
            merge_(o[:, qs], lse[:, :, qs], o_blk, lse_blk)     # online-softmax merge (Alg. 1, lines 13-16)
        if step + 1 < P:
            ring.wait()
            kv = nxt
    return o.to(q.dtype), lse


def _backward(group, do, q, k, v, o, lse, *, causal, scale, backend, stats=None, packing=None, wire=None):
    """Gradients (dq, dk, dv) in the input dtype, from the global o, lse of this rank's query rows; `wire`:
    the dtype the travelling dK, dV accumulators are sent in (None: the accumulator's)."""
    g = round_size(group_size(group), q.shape[1], packing)
    if g > 1:
        return _backward_rounds(group, do, q, k, v, o, lse, causal=causal, scale=scale, backend=backend, stats=stats,
                                g=g)
    ring_kv, ring_dkv = Ring(group, "backward", stats), Ring(group, "backward", stats)
    P, r, s = ring_kv.world, ring_kv.rank, q.shape[1]
    acc = acc_dtype(q.dtype)
    if wire is None and wire_dtype(P - 1, q.dtype, acc) == q.dtype:
        # P = 2: an accumulator makes one hop, one call's dK, dV summed once at its owner, so it travels in the
        # input dtype (the wire-precision policy): ring-te's bytes. On a GPU the same values (the kernels return
        # them in that dtype, and the fp32 accumulator held nothing else)
        wire = q.dtype
    dq = None
    kv = (k, v)
    dkv_in = None                                               # travelling dK, dV of the block in hand
    for step in range(P):
        if step + 1 < P:
            nxt = ring_kv.send_recv(kv)
        src = (r - step) % P
        dkv_blocks = []
        for qs, ks, mask, seg in zigzag_blocks(r, src, s, causal, packing):
            dq_b, dk_b, dv_b = block_bwd(do[:, qs], q[:, qs], kv[0][:, ks], kv[1][:, ks], o[:, qs], lse[:, :, qs],
                                         mask=mask, scale=scale, backend=backend, cu_seqlens_q=seg)
            if dq is None and qs == ALL:                        # step 0's one block covers every row: no zero-fill
                dq = dq_b.to(acc)
                continue
            if dq is None:                                      # packed: step 0 comes in pieces
                dq = torch.zeros(q.shape, dtype=acc, device=q.device)
            accumulate_(dq[:, qs], dq_b)
            dkv_blocks.append((ks, dk_b, dv_b))
        if step == 0 and not dkv_blocks:
            # Own block (step 0), one call over all keys: its result starts our dK, dV accumulator (kept here,
            # the last hop's sum added at the end).
            dk_acc, dv_acc = dk_b.to(acc), dv_b.to(acc)
        elif wire is not None and step > 0 and len(dkv_blocks) == 1 and dkv_blocks[0][1].dtype == wire:
            # A 16-bit wire and one block (every unpacked step): the hop's sum formed in fp32 and rounded to the
            # wire once, as the fp32 accumulator below would, but in one add into the received buffer (6 bytes an
            # element against 44 for cast, add, cast back; ring-te at P = 16 was 2.6 ms a rank behind ring).
            (ks, dk_b, dv_b), dkv_blocks = dkv_blocks[0], []
            if dkv_in is None:                                  # step 1: nothing travelled into block src yet
                dk_acc, dv_acc = torch.zeros_like(k, dtype=wire), torch.zeros_like(v, dtype=wire)
            else:
                ring_dkv.wait()
                dk_acc, dv_acc = dkv_in
            dk_acc[:, ks] += dk_b                               # sent below as they are (.to(wire): no copy)
            dv_acc[:, ks] += dv_b
        elif step == 0 or dkv_in is None:
            # Packed own block in pieces; or the accumulator of block src, which holds the contributions of
            # ranks src+1 .. r-1: none at step 1.
            dk_acc = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv_acc = torch.zeros_like(dk_acc)
        else:
            ring_dkv.wait()                                     # after the compute: the transfer overlapped it
            dk_acc, dv_acc = (t.to(acc) for t in dkv_in)
        for ks, dk_b, dv_b in dkv_blocks:
            accumulate_(dk_acc[:, ks], dk_b)
            accumulate_(dv_acc[:, ks], dv_b)
        if step == 0:
            dk_own, dv_own = dk_acc, dv_acc
        else:
            # Pass it on (rank r+1 holds block src next step); receive the accumulator of the next block.
            dkv_in = ring_dkv.send_recv((dk_acc, dv_acc) if wire is None else (dk_acc.to(wire), dv_acc.to(wire)))
        if step + 1 < P:
            ring_kv.wait()
            kv = nxt
    if P > 1:                                                   # the last hop brought our own block's sum home
        ring_dkv.wait()
        dk_own += dkv_in[0]
        dv_own += dkv_in[1]
    return dq.to(q.dtype), dk_own.to(k.dtype), dv_own.to(v.dtype)


def ring_attention(q, k, v, *, group, causal: bool = True, softmax_scale: float, backend: str | None = None,
                   comm_stats: CommStats | None = None, packing=None):
    """Zigzag ring attention on validated shards: q [b, s, h, d], k, v [b, s, h_kv, d] -> [b, s, h, d]
    (`packing`: the `_packing.Packing` of a packed sequence, each document zigzagged on its own)."""
    return in_zigzag_order(packing, causal, q, k, v, lambda q, k, v: CPAttention.apply(
        q, k, v, saving_inputs(ring_forward), _backward, group, causal, softmax_scale, backend, comm_stats, packing))


def _backward_te(group, do, q, k, v, o, lse, **kw):
    return _backward(group, do, q, k, v, o, lse, wire=q.dtype, **kw)


def ring_te_attention(q, k, v, *, group, causal: bool = True, softmax_scale: float, backend: str | None = None,
                      comm_stats: CommStats | None = None, packing=None):
    """`ring_attention` with TransformerEngine's p2p byte budget (dK, dV travel in the input dtype): the
    benchmark's and cost model's `ring-te` baseline."""
    return in_zigzag_order(packing, causal, q, k, v, lambda q, k, v: CPAttention.apply(
        q, k, v, saving_inputs(ring_forward), _backward_te, group, causal, softmax_scale, backend, comm_stats, packing))
