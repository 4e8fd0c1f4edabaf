"""Plain-PyTorch tree attention: the definition DeFT (kernels/deft.py) is tested against, and the two
baselines of the paper's benchmark (deft.txt, Table 2 / Remark 3.2).

A tree is `parents` [n_nodes] (-1: a root) and `node_slots` (per node, the pool slots of its tokens in order);
a query sits in node `query_node` and sees every token of its ancestors plus the first `query_seen` tokens of
its own node (None: all of them). Its path is that list of slots, root first.

    paths = query_paths(parents, node_slots, query_node, query_seen)          # list of LongTensor slots
    o, lse = tree_attention_reference(q [n_q, h, d], k_pool [num_slots, h_kv, d], v_pool, paths)   # fp64
    o = flash_decoding_baseline(q, k_pool, v_pool, paths)   # Q-guided: each query gathers and reads its path
    o = medusa_tree_attention(q, k, v, dense_tree_mask(paths, tree_slots))  # dense [n_q, n_kv] mask, GEMMs
"""
from __future__ import annotations

import torch


def query_paths(parents, node_slots, query_node, query_seen=None) -> list[torch.Tensor]:
    """Each query's visible pool slots, root first: ancestors whole, its own node's first query_seen tokens."""
    parents = [int(p) for p in parents]
    slots = [torch.as_tensor(s, dtype=torch.long).flatten() for s in node_slots]
    out = []
    for i, u in enumerate(int(x) for x in query_node):
        chain, a = [], parents[u]
        while a >= 0:
            if len(chain) > len(parents):
                raise ValueError("parents: a cycle")
            chain.append(slots[a])
            a = parents[a]
        own = slots[u] if query_seen is None else slots[u][:int(query_seen[i])]
        out.append(torch.cat(chain[::-1] + [own]))
    return out


def _padded(paths, device):
    """[n_q, L] slot indices (0 where padded) and the valid mask [n_q, L]."""
    n_q, length = len(paths), max((p.numel() for p in paths), default=0)
    idx = torch.zeros(n_q, max(length, 1), dtype=torch.long)
    valid = torch.zeros(n_q, max(length, 1), dtype=torch.bool)
    for i, p in enumerate(paths):
        idx[i, :p.numel()], valid[i, :p.numel()] = p, True
    return idx.to(device), valid.to(device)


def tree_attention_reference(q, k_pool, v_pool, paths, *, softmax_scale: float | None = None,
                             dtype=torch.float64):
    """softmax(q k^T * scale) v over each query's path, in `dtype` (fp64 by default).

    q [n_q, h, d]; k_pool, v_pool [num_slots, h_kv, d]; paths: n_q LongTensors of slots.
    Returns o [n_q, h, d] and lse [n_q, h] in `dtype` (-inf, o = 0 for an empty path).
    """
    n_q, h, d = q.shape
    h_kv = k_pool.shape[1]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    idx, valid = _padded(paths, q.device)
    kk, vv = (x.to(dtype)[idx] for x in (k_pool, v_pool))                   # [n_q, L, h_kv, d]
    qq = q.to(dtype).view(n_q, h_kv, h // h_kv, d)
    s = torch.einsum("qkgd,qlkd->qkgl", qq, kk) * scale
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)                                           # [n_q, h_kv, g]
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    o = torch.einsum("qkgl,qlkd->qkgd", p, vv)
    return o.reshape(n_q, h, d), lse.reshape(n_q, h)


def flash_decoding_baseline(q, k_pool, v_pool, paths, *, softmax_scale: float | None = None,
                            chunk_bytes: int = 1 << 30):
    """Q-guided grouping (Flash-Decoding on branches): each query gathers its whole path's K, V out of the pool
    and attends to it (SDPA), so a shared prefix is read once per query. Queries go in chunks whose gathered
    K, V fit `chunk_bytes`. q [n_q, h, d] -> o [n_q, h, d] in q's dtype."""
    n_q, h, d = q.shape
    h_kv = k_pool.shape[1]
    g = h // h_kv
    idx, valid = _padded(paths, q.device)
    per_q = 2 * idx.shape[1] * h_kv * d * k_pool.element_size()
    step = max(1, chunk_bytes // max(1, per_q))
    out = torch.empty_like(q)
    for a in range(0, n_q, step):
        b = min(n_q, a + step)
        kk, vv = (x[idx[a:b]].transpose(1, 2) for x in (k_pool, v_pool))    # [c, h_kv, L, d]
        # GQA without copies: the g heads of a KV head are g query rows of that head.
        qq = q[a:b].view(b - a, h_kv, g, d)
        o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=valid[a:b, None, None, :],
                                                              scale=softmax_scale)
        out[a:b] = o.reshape(b - a, h, d)
    return out


def dense_tree_mask(paths, tree_slots) -> torch.Tensor:
    """[n_q, n_kv] bool: query i sees the token stored at tree_slots[j] (Medusa's dense causal mask)."""
    tree_slots = torch.as_tensor(tree_slots, dtype=torch.long).cpu()
    col = torch.full((int(tree_slots.max()) + 1 if tree_slots.numel() else 0,), -1, dtype=torch.long)
    col[tree_slots] = torch.arange(tree_slots.numel())
    mask = torch.zeros(len(paths), tree_slots.numel(), dtype=torch.bool)
    for i, p in enumerate(paths):
        mask[i, col[p.cpu()]] = True
    return mask


def medusa_tree_attention(q, k, v, mask, *, softmax_scale: float | None = None):
    """Medusa-style tree attention: one GEMM over all tree tokens, a dense additive mask, softmax, one GEMM
    (every intermediate [h, n_q, n_kv] goes through memory). q [n_q, h, d]; k, v [n_kv, h_kv, d] (an unpaged,
    contiguous tree cache); mask [n_q, n_kv] bool. Returns o [n_q, h, d] in q's dtype."""
    n_q, h, d = q.shape
    h_kv = k.shape[1]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    qq = q.view(n_q, h_kv, h // h_kv, d)
    s = torch.einsum("qkgd,nkd->kgqn", qq, k) * scale
    bias = torch.zeros(mask.shape, dtype=s.dtype, device=s.device).masked_fill_(~mask.to(s.device), float("-inf"))
    p = torch.softmax(s + bias, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("kgqn,nkd->qkgd", p, v).reshape(n_q, h, d)
