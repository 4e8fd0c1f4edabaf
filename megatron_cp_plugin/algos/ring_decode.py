"""Ring decoding: the baseline tree decoding is measured against (Ring Attention applied to decoding).

q [b, n_q, h, d] replicated; k, v [b, s_local, h_kv, d] this rank's cache shard, all shards the same length
(pad shorter ones and mark the padding with kv_positions = -1; positions travel with their K, V). The local
step is the same split-KV kernel as tree decoding's, so the two differ only in what crosses the links.
Each rank passes its K, V shard round the ring (P - 1 steps, the next transfer posted before the current
block's compute) and merges the partial of every shard into its output, so every rank moves the whole
cache once per decoded token, where tree decoding moves one (o, lse) per query.
"""
from __future__ import annotations

import torch

from ..comm import Ring, resolve_group
from ..kernels.local_attn import decode_fwd
from ..kernels.merge import merge_


def ring_decode(q, k, v, *, group=None, softmax_scale: float | None = None, backend: str | None = None,
                kv_positions: torch.Tensor | None = None):
    """[b, n_q, h, d] attention of replicated q over every rank's k, v shard (no autograd).
    kv_positions [b, s_local]: -1 marks padding (ragged shards); other values only need to be >= 0."""
    group = resolve_group(group)
    ring = Ring(group, "forward")
    with torch.no_grad():
        o = lse = None
        kv = (k, v) if kv_positions is None else (k, v, kv_positions)
        for step in range(ring.world):
            if step + 1 < ring.world:
                nxt = ring.send_recv(kv)
            o_b, lse_b = decode_fwd(q, kv[0], kv[1], scale=softmax_scale, backend=backend,
                                    kv_positions=None if kv_positions is None else kv[2])
            if o is None:
                o, lse = o_b, lse_b
            else:
                merge_(o, lse, o_b, lse_b)
            if step + 1 < ring.world:
                ring.wait()
                kv = nxt
    return o.to(q.dtype)
