"""The causal work of one (query shard, key/value shard) pair under the zigzag layout.

Rank r holds chunks r and 2P-1-r of the 2P-chunk sequence, in that order. For query shard of rank a and key
shard of rank c (P >= 1):
  a == c: the local sequence is in global order, so the block is one causal triangle;
  c <  a: both query chunks come after key chunk c and before key chunk 2P-1-c: all queries x first key half;
  c >  a: query chunk a precedes both key chunks; query chunk 2P-1-a follows both: second query half x all keys.
Every off-diagonal pair is half a block, so all ranks do equal work at every ring step.

Packed sequences (`Packing`): every document is zigzagged on its own, so a shard holds, per document, its
chunk r then its chunk 2P-1-r. Ring and burst reorder their local rows once (`Packing.zigzag_order`, outside
the autograd function) into all documents' first chunks, then all second chunks: the halves above become
contiguous halves again, each packed with boundaries cu_seqlens / 2P, and every block is one or a few varlen
kernel calls with equal query and key segments (`zigzag_blocks`).
"""
from __future__ import annotations

from ._packing import Packing

ALL = slice(None)


def zigzag_pair(q_owner: int, kv_owner: int, s_local: int, causal: bool) -> tuple[slice, slice, str]:
    """(query rows, key rows, mask) of the block that query shard `q_owner` computes with key shard `kv_owner`."""
    half = s_local // 2
    if not causal:
        return ALL, ALL, "none"
    if q_owner == kv_owner:
        return ALL, ALL, "causal"
    if kv_owner < q_owner:
        return ALL, slice(0, half), "none"
    return slice(half, None), ALL, "none"


def zigzag_blocks(q_owner: int, kv_owner: int, s_local: int, causal: bool, packing: Packing | None = None):
    """[(query rows, key rows, mask, segments)]: the kernel calls of the block (q_owner's queries, kv_owner's
    keys); segments None when unpacked. Packed and causal, rows are in `Packing.zigzag_order`: A = first
    chunks, B = second chunks of every document, and per document the pair above splits into (A, B) pieces."""
    if packing is None:
        return [zigzag_pair(q_owner, kv_owner, s_local, causal) + (None,)]
    if not causal or packing.world == 1:          # documents whole, in order: one call over the shard
        return [(ALL, ALL, "causal" if causal else "none", packing.local)]
    half = s_local // 2
    a, b, seg = slice(0, half), slice(half, None), packing.halves
    if q_owner == kv_owner:                       # A sees A causally; B sees all of A, and B causally
        return [(a, a, "causal", seg), (b, a, "none", seg), (b, b, "causal", seg)]
    if kv_owner < q_owner:                        # key chunk c precedes both query chunks; 2P-1-c follows both
        return [(a, a, "none", seg), (b, a, "none", seg)]
    return [(b, a, "none", seg), (b, b, "none", seg)]   # query chunk a precedes both keys, 2P-1-a follows both


def chunk_run(part, rows: slice):
    """Rows `rows` of stacked chunks [m, b, n, h, d] (one chunk of each of m ranks) as one run of keys
    [b, m' n, h, d]: a view at b = 1 (long-context training's micro-batch), a copy for b > 1."""
    x = part[rows]
    m, b, n = x.shape[:3]
    return x.transpose(0, 1).reshape(b, m * n, *x.shape[3:])


def put_run_(dst, run) -> None:
    """dst [m, b, n, h, d] (stacked chunks, a view) = run [b, m n, h, d]: chunk_run's inverse, each rank's rows of a
    call's keys (or queries) back to its chunk. The calls of a pass write disjoint rows, so a copy: no zero fill to
    read back (at 128k over P = 64 the rounds' fp32 partial fills and strided adds were 5 of a rank's 31 ms, H100)."""
    dst.copy_(run.reshape(dst.shape[1], dst.shape[0], *dst.shape[2:]).transpose(0, 1))
