"""The causal work of one (query shard, key/value shard) pair under the zigzag layout.

Rank r holds chunks r and 2P-1-r of the 2P-chunk sequence, in that order. For query shard of rank a and key
shard of rank c (P >= 1):
  a == c: the local sequence is in global order, so the block is one causal triangle;
  c <  a: both query chunks come after key chunk c and before key chunk 2P-1-c: all queries x first key half;
  c >  a: query chunk a precedes both key chunks; query chunk 2P-1-a follows both: second query half x all keys.
Every off-diagonal pair is half a block, so all ranks do equal work at every ring step.
"""
from __future__ import annotations

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
