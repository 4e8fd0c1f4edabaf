"""DeepSpeed-Ulysses (Jacobs et al. 2023, *DeepSpeed Ulysses: System Optimizations for Enabling Training of
Extreme Long Sequence Transformer Models*): attention parallel over heads after an all-to-all.

Each rank holds a sequence shard of all heads. One all-to-all turns that into all tokens of h / P heads (Q)
and of the K, V heads those queries read; the rank runs ordinary local attention over the whole sequence in
token order (kernels.local_attn.block_fwd / block_bwd, a plain causal or no mask, or the varlen kernel with the
documents' own cu_seqlens when packed); a second all-to-all returns the output to its sequence shard. The
backward is the same: dO all-to-all to heads, the local backward from the saved head-sharded (q, k, v, o, lse),
dQ, dK, dV all-to-all back. Every rank does the same work whatever the mask (all of the sequence, h / P heads),
so the layout need not balance anything: it is the zigzag one, Megatron's own, so that the data path and RoPE
are the ring's, and so that `ulysses_ring.py` can run the ring over groups of ranks on the same shards (a group
of consecutive zigzag ranks holds two zigzag chunks of the group-level sequence). The gathered rows are put in
the order the attention wants by one index, built once per shape (`_order`).

Heads. h % P == 0 is all that is required. Member u gets q heads u h/P .. (u + 1) h/P - 1 and exactly the K, V
heads those read (q head i reads K, V head i // g, g = h / h_kv): heads lo_u .. hi_u - 1, k_u = hi_u - lo_u of them
(`kv_spans`). With h_kv % P == 0 that is h_kv / P heads, each sent to one member; with P % h_kv == 0 one head,
replicated to the P / h_kv members whose queries read it; otherwise a K, V group that straddles two members goes
to both (h = 6, h_kv = 3, P = 2: member 0 reads {0, 1}, member 1 {1, 2}), and k_u may differ between members
(h = 12, h_kv = 4, P = 6: 1, 2, 1, 1, 2, 1), sent with unequal splits (comm.all_to_all), not padded to the
largest, which would send bytes for nothing. The dK, dV partials of a head read by several members come back from
each, rounded once to the input dtype, and are summed in fp32 at the owner, in member order (docs/design.md, wire
precision, rule 2). The kernels take uniform GQA (q head i of a call reads its K, V head i // group), so where a
member's q heads per K, V head vary (a partial group at either end) its heads are cut into at most three segments
of uniform group, each its own kernel call (ulysses-ring: its own ring pass), `head_segments`: the bytes and
flops of one call, in more launches (the ring: more, smaller messages). Expanding K, V to uniform groups instead
would raise ulysses-ring's ring bytes (h = 6, h_kv = 3, U = 2: 3 K, V heads per rank instead of 2), and padding the
q heads to a uniform group the flops (h = 12, h_kv = 4, P = 3: 6 q slots for 4 heads). h % P != 0 is a one-line
ValueError before any collective (`check_heads`).

Head chunks (`chunk_count`). Each all-to-all sits between the layer's work and the attention, which waits for
it. Where every chunk still sends >= PIPELINE_MIN_BYTES, ulysses cuts its heads into C <= MAX_HEAD_CHUNKS chunks,
each an ulysses call of its own (q heads c h / C .. and the K, V heads they read): every chunk's Q, K, V all-to-all
is posted at once (comm.all_to_all_start; NCCL runs them in order on its stream), chunk c attends as soon as its
own has arrived while the later ones travel, and its output's all-to-all back is posted as it ends; the backward
likewise with dO and dQ, dK, dV. Only the first chunk's inputs and the last one's outputs stay exposed, 1 / C of
the bytes each way. Same bytes (chunks that would send a K, V head to more members than the whole call does are
not taken), same kernels per head, the same bits on the CPU (tests/test_cp_attention.py).

Causal zigzag shards run the forward by `_ulysses_halves`' schedule where it applies (`by_halves`): the same bytes
in two all-to-alls each way by sequence half, the first half attending while the second travels, the second half
as ring's non-causal + causal blocks; the backward is this path's.

Design notes (looked up, not copied): TransformerEngine's `cp_comm_type=a2a` (`AttnFuncWithCPAndQKVOA2A`) and
yunchang's Ulysses attention exchange each of Q, K, V in its own all-to-all and need the KV heads divisible by
the group; here Q, K, V share one all-to-all (comm.all_to_all packs them), as do dQ, dK, dV, and K, V heads the
group cannot split are sent to the members that read them rather than refused.

Bytes sent by member u per call (e = element size; s = s_local; k_u its K, V heads, K = k_0 + .. + k_{P-1}; an
all-to-all over g ranks sends g - 1 chunks, here of unequal K, V sizes):
  forward  (P - 1) * b * s * d * e * 2 h / P + 2 * b * s * d * e * (K - k_u)     (Q, K, V in; O back)
  backward (P - 1) * b * s * d * e * (2 h / P + 2 k_u)                           (dO in; dQ, dK, dV back)
When every k_u = k (h_kv % P == 0: k = h_kv / P; P % h_kv == 0: k = 1; h = 6, h_kv = 3, P = 2: k = 2) both are
(P - 1) * b * s * d * e * (2 h / P + 2 k) at every member; the mean over members is that with k = K / P always.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm import CommStats, PostedAllToAll, all_to_all_start, send_buffer
from ..kernels.local_attn import acc_dtype, block_bwd, block_fwd
from ..kernels.segments import Segments, to_device
from ._function import CPAttention
from ._layout import layout_positions
from ._packing import Packing, _zigzag_order
from . import _ulysses_halves as halves
from . import ring as _ring


def check_heads(algo: str, h: int, h_kv: int, size: int) -> None:
    """ValueError naming the heads unless an all-to-all over `size` ranks can split the q heads (h % size == 0);
    any K, V heads then can (h % h_kv == 0 is checked with the shapes): each member gets those its queries read."""
    if h % size:
        raise ValueError(f"heads: algo={algo!r} splits the q heads over its all-to-all of {size} ranks, but "
                         f"{h} q heads are not divisible by {size}")


@functools.lru_cache(maxsize=256)
def kv_spans(h: int, h_kv: int, size: int) -> tuple[tuple[int, int], ...]:
    """(lo, hi) for each member u: the K, V heads lo .. hi - 1 its q heads u h/size .. (u + 1) h/size - 1 read
    (q head i reads K, V head i // (h / h_kv)). Consecutive members' spans overlap in at most one head."""
    hu, g = h // size, h // h_kv
    return tuple((u * hu // g, ((u + 1) * hu - 1) // g + 1) for u in range(size))


@functools.lru_cache(maxsize=256)
def head_segments(h: int, h_kv: int, size: int, me: int) -> tuple[tuple[int, int, int, int], ...]:
    """Member me's heads cut into uniform GQA blocks for the kernels: (q0, q1, k0, k1), indices into its own
    q heads and its K, V heads (kv_spans), q1 - q0 a multiple of k1 - k0. One block when every K, V head it reads
    serves the same number of its q heads (h_kv % size == 0, size % h_kv == 0, or aligned groups), else at most
    three: a partial group at either end, the whole groups between."""
    hu, g = h // size, h // h_kv
    a = me * hu
    lo, hi = kv_spans(h, h_kv, size)[me]
    segs = []
    for j in range(lo, hi):
        q0, q1 = max(a, j * g) - a, min(a + hu, (j + 1) * g) - a          # its q heads that read K, V head j
        if segs and segs[-1][4] == q1 - q0:
            segs[-1][1], segs[-1][3] = q1, j - lo + 1
        else:
            segs.append([q0, q1, j - lo, j - lo + 1, q1 - q0])
    return tuple(tuple(x[:4]) for x in segs)


@dataclass(frozen=True)
class HeadsPlan:
    """The ranks of one head all-to-all and, for the hierarchical variant, the ring across such groups."""

    a2a: object
    """Process group of the all-to-all (None: one member, nothing to exchange)."""
    size: int
    """U, its members."""
    me: int
    """This rank's index in it."""
    members: tuple[int, ...]
    """The CP-group ranks of its members, in all-to-all order (consecutive ranks)."""
    world: int
    """P, the CP group size."""
    h_kv: int
    """K, V heads of the call (the gradients of a head several members read are summed back at its owner)."""
    ring: object = None
    """Process group of the ring across the P / U groups (None: no ring)."""
    groups: int = 1
    """G = P / U."""
    ring_rank: int = 0
    """This rank's group index (its rank in the ring)."""

    def order(self, s: int, packing, causal: bool, device):
        """(idx, inv): the received rows [members' shards, concatenated] taken at idx are in the attention's
        order; rows in that order taken at inv are back in the all-to-all's."""
        offs = packing.offsets if packing is not None else None
        idx, inv = _order(self.world * s, offs, self.world, self.members, self.groups, self.ring_rank, causal)
        return _on(idx, device), _on(inv, device)

    def ring_packing(self, packing):
        return Packing.of(packing.offsets, self.groups) if packing is not None else None


@functools.lru_cache(maxsize=64)
def _order(seq_len, offsets, world, members, groups, ring_rank, causal):
    got = torch.cat([layout_positions(seq_len, "zigzag", rank=p, world_size=world, cu_seqlens=offsets)
                     for p in members])
    # Wanted: this group's rows as a zigzag shard over the G groups (G = 1: token order), which is what
    # `ring.py` expects; packed and causal, in `Packing.zigzag_order` as its caller `in_zigzag_order` gives it.
    want = layout_positions(seq_len, "zigzag", rank=ring_rank, world_size=groups, cu_seqlens=offsets)
    if offsets is not None and causal and groups > 1:
        want = want[_zigzag_order(offsets, groups, torch.device("cpu"))[0]]
    where = torch.full((seq_len,), -1, dtype=torch.long)
    where[got] = torch.arange(got.numel())
    idx = where[want]
    assert idx.numel() == got.numel() and bool((idx >= 0).all()), "the group's tokens differ from the ring's"
    return idx, torch.argsort(idx)


@functools.lru_cache(maxsize=64)
def _on(x, device):
    return to_device(x, device)


def _kv_split(spans, size: int):
    """How K, V heads with these spans travel: ("even", None) every head to one member, in order; ("index", heads)
    equal counts, heads[u k .. (u + 1) k - 1] to member u (one index_select, equal chunks); ("uneven", None) member
    counts differ: one slice per member, unequal chunks."""
    widths = {hi - lo for lo, hi in spans}
    if len(widths) > 1:
        return "uneven", None
    w = widths.pop()
    if spans == tuple((u * w, (u + 1) * w) for u in range(size)):
        return "even", None
    return "index", torch.cat([torch.arange(lo, hi) for lo, hi in spans])


def to_heads(plan: HeadsPlan, xs, idx, stats, phase) -> PostedAllToAll:
    """[(x [b, s, H, d], K, V spans or None)] -> [x' [b, U s, H', d]]: all tokens of the group and this member's
    heads (None: H / U of them, in member order; spans: kv_spans[me]), rows in the attention's order; one all-to-all
    for all of them, posted: `.wait()` returns the list."""
    U = plan.size
    send, recv = [], []
    for x, spans in xs:
        b, s, H, d = x.shape
        how, heads = _kv_split(spans, U) if spans is not None else ("even", None)
        if how == "uneven":
            send.append([x[:, :, lo:hi] for lo, hi in spans])
            n = spans[plan.me][1] - spans[plan.me][0]
            recv.append([(b, s, n, d)] * U)
            continue
        if heads is not None:
            x = x.index_select(2, heads.to(x.device))
            H = x.shape[2]
        send.append(x.reshape(b, s, U, H // U, d).permute(2, 0, 1, 3, 4))          # [U, b, s, H / U, d]
        recv.append(None)
    # each received part [U, b, s, hh, d], a view of the receive buffer (stacked where the chunks were unequal)
    return all_to_all_start(plan.a2a, send, stats, phase, recv if any(recv) else None).then(
        lambda parts: [_gather_rows((torch.stack(r) if isinstance(r, list) else r).transpose(0, 1), idx)
                       for r in parts])


def _gather_rows(rt, idx):
    """rt [b, U, s, hh, d] (strided: the parts share the receive buffer) -> [b, U s, hh, d], row i = rt's row idx[i]
    of the members' shards concatenated: one copy. Zigzag shards are 2 U - 1 runs of consecutive rows, copied as
    slices (torch.cat); packed documents' many runs by one index kernel. (The reshape to [b, U s, ...] and then
    index_select were two copies; aten::index over all rows ran at 0.65 TB/s, 2.7B 64k on an H200: 0.52 ms a
    call where a slice copy streams.)"""
    runs, member, row = _row_runs(idx, rt.shape[2])
    if runs is not None:
        return torch.cat([rt[:, u, a:b] for u, a, b in runs], dim=1)
    return rt[:, member, row]


@functools.lru_cache(maxsize=64)
def _row_runs(idx, s):
    """idx (into the members' shards of s rows, concatenated; one of the cached `_order` tensors, so this runs once
    per shape) as runs ((member, first row, end row), ...) of consecutive rows of one member where there are at
    most 64 of them (the zigzag layout: 2 U - 1), else None; and as (member, row) index tensors."""
    member, row = idx.div(s, rounding_mode="floor"), idx.remainder(s)
    m, r = member.cpu(), row.cpu()
    cut = ((m[1:] != m[:-1]) | (r[1:] != r[:-1] + 1)).nonzero().flatten() + 1
    if cut.numel() >= 64:
        return None, member, row
    starts, ends = [0] + cut.tolist(), cut.tolist() + [idx.numel()]
    return tuple((int(m[a]), int(r[a]), int(r[a]) + e - a) for a, e in zip(starts, ends)), member, row


def to_sequence(plan: HeadsPlan, xs, order, stats, phase, out) -> PostedAllToAll:
    """The inverse of `to_heads`: [(x' [b, U s, hh, d], spans or None)] -> out [x [b, s, H, d]] (views to write
    into): None, the members' heads side by side (H = U hh); spans, each K, V head's partials from the members that
    read it (kv_spans) summed in fp32 at the owner. `order`: `HeadsPlan.order`'s (idx, inv). Posted: the results
    are in `out` after `.wait()`."""
    U, (idx, inv) = plan.size, order
    hows = [_kv_split(spans, U)[0] if spans is not None else "even" for _, spans in xs]
    recv = [[(x.shape[0], x.shape[1] // U, hi - lo, x.shape[3]) for lo, hi in spans] if how == "uneven" else None
            for (x, spans), how in zip(xs, hows)]
    # Each x's rows go back to their members' shards straight into the send buffer (`_scatter_rows`): one
    # streaming copy a tensor where an index_select and the packing were two, the first an index kernel.
    packed, send = send_buffer(U, [(x.dtype, (U, x.shape[0], x.shape[1] // U) + x.shape[2:]) for x, _ in xs],
                               xs[0][0].device)
    for (x, _), dst in zip(xs, send or ()):
        _scatter_rows(x, dst, idx)
    if send is None:                                                # mixed element sizes: parts built apart
        packed, send = None, [x.index_select(1, inv).view(x.shape[0], U, x.shape[1] // U, *x.shape[2:])
                              .transpose(0, 1) for x, _ in xs]
    span_list = [spans for _, spans in xs]                          # not xs: the tensors sent may go now

    def finish(parts):
        for r, spans, how, dst in zip(parts, span_list, hows, out):
            if how == "even":                                       # r [U, b, s, hh, d]: member u's heads at u
                b, s, H, d = dst.shape
                dst.view(b, s, U, H // U, d).copy_(r.permute(1, 2, 0, 3, 4))
            elif how == "uneven":
                dst.copy_(_sum_at_owner(torch.cat(r, 2), spans))  # [b, s, k_0 + .. + k_{U-1}, d] summed
            else:
                b, s = r.shape[1], r.shape[2]
                dst.copy_(_sum_at_owner(r.permute(1, 2, 0, 3, 4).reshape(b, s, -1, r.shape[4]), spans))
        return out
    return all_to_all_start(plan.a2a, send, stats, phase, recv if any(recv) else None, packed=packed).then(finish)


def _scatter_rows(x, dst, idx):
    """x [b, U s, hh, d] in the attention's order -> dst [U, b, s, hh, d] (a view of the send buffer): dst's row
    (u, r) = x's row i where idx[i] = u s + r, the inverse of `_gather_rows`. Zigzag shards: 2 U - 1 runs copied as
    slices; packed documents' many runs: one index_put."""
    runs, member, row = _row_runs(idx, dst.shape[2])
    if runs is None:
        dst.transpose(0, 1)[:, member, row] = x
        return
    at = 0
    for u, a, e in runs:
        dst[u, :, a:e].copy_(x[:, at:at + e - a])
        at += e - a


def _sum_at_owner(dkv, spans):
    """dK or dV [b, s, k_0 + .. + k_{U-1}, d], the members' partials side by side (member u's for its heads
    spans[u]) -> [b, s, h_kv, d]: every head the fp32 sum of its partials, added in member order (deterministic,
    unlike an index_add with repeated indices on GPUs), rounded once."""
    acc = torch.zeros(dkv.shape[:2] + (spans[-1][1], dkv.shape[3]), dtype=acc_dtype(dkv.dtype), device=dkv.device)
    at = 0
    for lo, hi in spans:
        acc[:, :, lo:hi] += dkv[:, :, at:at + hi - lo]
        at += hi - lo
    return acc.to(dkv.dtype)


def _per_segment(segs, fn, args, dims):
    """fn(*args) on each uniform-GQA segment of this member's heads (head_segments), results concatenated along
    `dims`; args: (tensor, where) with where "q" (q heads on dim 2), "kv" (K, V heads on dim 2) or "lse" (q heads
    on dim 1). One segment (every case but a partial group at either end): fn on the whole tensors, no copies."""
    if len(segs) == 1:
        return fn(*(x for x, _ in args))
    cut = {"q": lambda x, s: x[:, :, s[0]:s[1]], "kv": lambda x, s: x[:, :, s[2]:s[3]],
           "lse": lambda x, s: x[:, s[0]:s[1]]}
    outs = [fn(*(cut[w](x, s) for x, w in args)) for s in segs]
    return tuple(torch.cat(parts, d) for parts, d in zip(zip(*outs), dims))


PIPELINE_MIN_BYTES = 1 << 62
"""Ulysses cuts its heads into chunks (`head_chunks`) only where each chunk's Q, K, V all-to-all still sends at
least this many bytes per rank. Off (out of reach) since it was timed: on 2 x H200 over NVLink on 2026-11-27,
chunks on (32 MiB, the first value) against off in one run, `bench attention --seq 131072` (16 heads) fwd+bwd
247 ms on against 240 off (0.541 and 0.525 of one GPU), and GPT-3 2.7B at 64k (`gpu_memory_check.sh`, b2.7_64k)
4.65 s a step on against 4.57 s (MFU 0.439 and 0.447). There the all-to-all is 1-3% of the attention, and a
call of a quarter of the heads loses more in the kernel than the overlap hides. Where links are slow the balance
may turn (not measured): set this (e.g. 32 << 20) in every rank to pipeline; tests force it to 0."""
MAX_HEAD_CHUNKS = 4
"""At most this many chunks: the first chunk's all-to-all in and the last one's out stay exposed (1 / C of the
bytes each way), and every chunk is a kernel call of its own."""


def head_chunks(plan: HeadsPlan, h: int, h_kv: int, nbytes: int) -> int:
    """C, the head chunks this call pipelines (`chunk_count`); 1 without an all-to-all, and for ulysses-ring,
    whose ring passes would share the time with a second communicator."""
    if plan.a2a is None or plan.ring is not None:
        return 1
    return chunk_count(h, h_kv, plan.size, nbytes)


def chunk_count(h: int, h_kv: int, U: int, nbytes: int) -> int:
    """C, the head chunks ulysses pipelines over an all-to-all of U ranks (1: none): chunk c is q heads c h / C ..
    (c + 1) h / C - 1 and the K, V heads they read, c h_kv / C .. (c + 1) h_kv / C - 1, an ulysses call of its own
    (C divides h_kv, U divides h / C), and only where the chunks send the bytes the whole call does (with GQA a
    chunk of fewer K, V heads than members would send its heads to several members: 8 q / 2 K, V heads over 2
    ranks in 2 chunks would send twice the K, V bytes). Every chunk's all-to-all is posted at once and NCCL runs
    them in order on its stream while the chunks before attend; each output's all-to-all back is posted as its
    chunk ends. `nbytes`: this rank's Q, K, V bytes."""
    whole = sum(hi - lo for lo, hi in kv_spans(h, h_kv, U))               # K, V heads received, over the members
    for c in range(MAX_HEAD_CHUNKS, 1, -1):
        if (h_kv % c == 0 and (h // c) % U == 0 and nbytes // c >= PIPELINE_MIN_BYTES
                and c * sum(hi - lo for lo, hi in kv_spans(h // c, h_kv // c, U)) == whole):
            return c
    return 1


def by_halves(plan: HeadsPlan, x, h_kv: int, causal: bool, packing, idx) -> bool:
    """Whether this call's forward runs `_ulysses_halves`' schedule (two all-to-alls by zigzag half, ring's blocks):
    causal, no packed documents, plain ulysses, one head chunk, K, V heads split evenly over the members in one
    uniform GQA block each, and the zigzag row order. `x`: q [b, s, h, d]."""
    b, s, h, d = x.shape
    U = plan.size
    if not (halves.ENABLED and causal and packing is None and plan.ring is None and plan.a2a is not None):
        return False
    nbytes = b * s * (h + 2 * h_kv) * d * x.element_size()        # this rank's Q, K, V bytes, as `_forward` counts
    return (head_chunks(plan, h, h_kv, nbytes) == 1 and _kv_split(kv_spans(h, h_kv, U), U)[0] == "even"
            and len(head_segments(h, h_kv, U, plan.me)) == 1 and halves.zigzag_halves(idx, s, U))


def _forward(plan: HeadsPlan, q, k, v, *, causal, scale, backend, stats=None, packing=None):
    idx, inv = plan.order(q.shape[1], packing, causal, q.device)
    if by_halves(plan, q, k.shape[2], causal, packing, idx):
        return halves.forward(plan, q, k, v, scale=scale, backend=backend, stats=stats)
    h, h_kv = q.shape[2], k.shape[2]
    C = head_chunks(plan, h, h_kv, (q.numel() + k.numel() + v.numel()) * q.element_size())
    hc, kc = h // C, h_kv // C                          # each chunk: hc q heads reading kc K, V heads
    spans = kv_spans(hc, kc, plan.size)

    def attend(q_h, k_h, v_h):
        if plan.ring is None:                   # all of the sequence here, in token order: one local call
            seg = Segments(packing.offsets) if packing is not None else None
            return block_fwd(q_h, k_h, v_h, mask="causal" if causal else "none", scale=scale, backend=backend,
                             cu_seqlens_q=seg)
        # ulysses-ring: the zigzag ring across the groups
        return _ring.ring_forward(plan.ring, q_h, k_h, v_h, causal=causal, scale=scale, backend=backend,
                                  stats=stats, packing=plan.ring_packing(packing))

    # Every chunk's Q, K, V to heads, posted at once: chunk c + 1's travel while chunk c attends
    ins = [to_heads(plan, [(q[:, :, c * hc:(c + 1) * hc], None), (k[:, :, c * kc:(c + 1) * kc], spans),
                           (v[:, :, c * kc:(c + 1) * kc], spans)], idx, stats, "forward") for c in range(C)]
    segs = head_segments(hc, kc, plan.size, plan.me)
    o, outs, saved = q.new_empty(q.shape), [], []        # contiguous, whatever q's strides
    for c in range(C):
        q_h, k_h, v_h = ins[c].wait()
        o_h, lse = _per_segment(segs, attend, [(q_h, "q"), (k_h, "kv"), (v_h, "kv")], (2, 1))
        outs.append(to_sequence(plan, [(o_h, None)], (idx, inv), stats, "forward",
                                [o[:, :, c * hc:(c + 1) * hc]]))
        saved += [q_h, k_h, v_h, o_h, lse]
    for posted in outs:
        posted.wait()
    return o, tuple(saved)


def _backward(plan: HeadsPlan, do, *saved, causal, scale, backend, stats=None, packing=None):
    # Also the backward of the halves' forward (`_ulysses_halves`), which saves what this path's forward does
    idx, inv = plan.order(do.shape[1], packing, causal, do.device)
    C = len(saved) // 5                                 # the forward's head chunks: (q_h, k_h, v_h, o_h, lse) each
    hc, kc = do.shape[2] // C, plan.h_kv // C
    spans = kv_spans(hc, kc, plan.size)
    ins = [to_heads(plan, [(do[:, :, c * hc:(c + 1) * hc], None)], idx, stats, "backward") for c in range(C)]

    def grads(do_h, q_h, k_h, v_h, o_h, lse):
        if plan.ring is None:
            seg = Segments(packing.offsets) if packing is not None else None
            return block_bwd(do_h, q_h, k_h, v_h, o_h, lse, mask="causal" if causal else "none", scale=scale,
                             backend=backend, cu_seqlens_q=seg)
        return _ring._backward(plan.ring, do_h, q_h, k_h, v_h, o_h, lse, causal=causal, scale=scale,
                               backend=backend, stats=stats, packing=plan.ring_packing(packing))

    segs = head_segments(hc, kc, plan.size, plan.me)
    b, s, _, d = do.shape
    dq, dk, dv = do.new_empty(do.shape), do.new_empty((b, s, plan.h_kv, d)), do.new_empty((b, s, plan.h_kv, d))
    outs = []
    for c in range(C):
        (do_h,) = ins[c].wait()
        q_h, k_h, v_h, o_h, lse = saved[5 * c:5 * c + 5]
        dq_h, dk_h, dv_h = _per_segment(segs, grads, [(do_h, "q"), (q_h, "q"), (k_h, "kv"), (v_h, "kv"),
                                                      (o_h, "q"), (lse, "lse")], (2, 2, 2))
        # Rounded to the input dtype once, here; dQ of a head comes from one member, dK, dV of a K, V head from
        # every member that reads it, summed in fp32 at the owner.
        q_cut, kv_cut = slice(c * hc, (c + 1) * hc), slice(c * kc, (c + 1) * kc)
        outs.append(to_sequence(plan, [(dq_h.to(do.dtype), None), (dk_h.to(do.dtype), spans),
                                       (dv_h.to(do.dtype), spans)], (idx, inv), stats, "backward",
                                [dq[:, :, q_cut], dk[:, :, kv_cut], dv[:, :, kv_cut]]))
    for posted in outs:
        posted.wait()
    return dq, dk, dv


def run_heads(plan: HeadsPlan, q, k, v, causal, softmax_scale, backend, comm_stats, packing):
    """Attention over the head all-to-all of `plan` (ulysses, ulysses-ring), heads already checked."""
    return CPAttention.apply(q, k, v, _forward, _backward, plan, causal, softmax_scale, backend, comm_stats,
                             packing)


def ulysses_attention(q, k, v, *, group, causal: bool = True, softmax_scale: float, backend: str | None = None,
                      comm_stats: CommStats | None = None, packing=None):
    """DeepSpeed-Ulysses on validated zigzag shards: q [b, s, h, d], k, v [b, s, h_kv, d] -> [b, s, h, d]; the
    all-to-all spans the whole group (h % P == 0, else ValueError; any h_kv dividing h)."""
    P, r = dist.get_world_size(group), dist.get_rank(group)
    check_heads("ulysses", q.shape[2], k.shape[2], P)             # before any collective
    plan = HeadsPlan(group if P > 1 else None, P, r, tuple(range(P)), P, k.shape[2])
    return run_heads(plan, q, k, v, causal, softmax_scale, backend, comm_stats, packing)
