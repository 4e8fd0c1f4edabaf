"""DeFT: tree-structured decode attention with shared prefixes (deft.txt, Sec. 3.2-3.3, Alg. 3-4), Triton.

Queries sit in a tree of KV nodes (a prompt, branches, thoughts, speculative tokens); a query attends to the
tokens on its root-to-node path, and to the leading `query_seen` tokens of its own node (causal inside a
multi-token node). The KV lives in a paged pool [num_slots, h_kv, d], addressed per token by a page table
(`node_slots`, any slot order). Two phases (Alg. 4, A.4):
  phase 1  one program per (work item, KV head): a work item is a KV range of the flattened tree and a tile of
           up to QT queries that see it (KV-guided grouping); the range is loaded once for the whole tile
           (GQA folded: the g = h / h_kv heads of each query are rows of the tile) and gives a partial
           (o, lse) per row, with a bit causal mask per token (one int64, bit i = tile query i sees it);
  phase 2  the tree-topology-aware reduction: each query merges the partials of the items it belongs to.
Groupings (`strategy`), the same kernels (Table 2 / Fig. 3):
  "flatten"     DeFT-Flatten: depth-first flattened tree KV cut into even splits of `split_len` tokens;
  "node"        DeFT-Node: one group per tree node (unbalanced: a 6k-token prompt next to 1-token nodes);
  "node_chunk"  DeFT-Node-Chunk: each node cut into chunks of `split_len` tokens;
  "qguided"     the Q-guided baseline (Flash-Decoding / Radix Attention on a paged cache): each query reads
                its whole path, split into `split_len` chunks; shared prefixes are re-read per query.

    plan = plan_deft(parents, node_slots, query_node, query_seen, num_heads=h, num_kv_heads=h_kv,
                     num_slots=k_pool.shape[0], strategy="flatten", device=q.device)   # once per tree step
    o, lse = deft_attention(q [n_q, h, d], k_pool [num_slots, h_kv, d], v_pool, plan)  # every layer
    # o [n_q, h, d] (q's dtype, or out_dtype), lse [n_q, h] fp32 natural log (-inf, o = 0: saw no key)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # no triton: available() is False; tests skip loudly, callers use deft_reference
    triton = tl = None

# One owner of the Triton-availability check and of the tile online softmax (the flash-decoding kernel's).
from . import _launch  # noqa: E402
from .flash_decode import available  # noqa: E402,F401  (re-exported: deft.available)

if triton is not None:
    from .flash_decode import online_softmax_step, softmax_finish  # noqa: E402

HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
STRATEGIES = ("flatten", "node", "node_chunk", "qguided")
BLOCK_N = 64            # keys per inner iteration
MAX_BLOCK_M = 128       # rows (queries x heads of a KV group) per tile
TARGET_PROGRAMS = 264   # about two waves of 132 SMs (H100 / H200)


@dataclass
class DeftPlan:
    """Phase-1 work items and phase-2 reduction lists for one tree step; shared by every layer.

    slots [n_flat] int32: pool slot of each flattened token; item_start, item_len [I] int32: the item's range
    of `slots`; item_q [I, qt] int32: its query tile (-1 padded); item_mask [I] int64: offset of its masks in
    `masks`, -1 when every tile query sees every token; masks [M] int64: bit i = tile query i sees the token;
    item_row [I] int64: the item's first row in the partial buffers (rows only for real (query, item) pairs);
    q_ptr [n_q + 1] int32 and q_ent [E] int64: the partial rows (item_row + tile slot * g) of each query.
    """
    strategy: str
    n_q: int
    num_heads: int
    num_kv_heads: int
    num_slots: int
    block_m: int
    block_n: int
    qt: int
    split_len: int
    slots: torch.Tensor
    item_start: torch.Tensor
    item_len: torch.Tensor
    item_q: torch.Tensor
    item_mask: torch.Tensor
    masks: torch.Tensor
    item_row: torch.Tensor
    q_ptr: torch.Tensor
    q_ent: torch.Tensor

    @property
    def num_items(self) -> int:
        return self.item_start.shape[0]

    def kv_tokens_loaded(self) -> int:
        """Tokens phase 1 loads per KV head (a range counts once per query tile that reads it)."""
        return int(self.item_len.sum())

    def to(self, device) -> "DeftPlan":
        kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return DeftPlan(**kw)


def _dfs(parents: list[int]):
    """Preorder of the forest, each node's preorder index and subtree size (in nodes)."""
    n = len(parents)
    children: list[list[int]] = [[] for _ in range(n)]
    roots = []
    for i, p in enumerate(parents):
        if p == -1:
            roots.append(i)
        elif 0 <= p < n and p != i:
            children[p].append(i)
        else:
            raise ValueError(f"parents[{i}] = {p}: must be -1 (a root) or another node's index in [0, {n})")
    order, pre, nsub = [], [-1] * n, [1] * n
    stack = roots[::-1]
    while stack:
        u = stack.pop()
        pre[u] = len(order)
        order.append(u)
        stack.extend(children[u][::-1])
    if len(order) != n:
        raise ValueError("parents: the nodes do not form a forest (a cycle without a root)")
    for u in reversed(order):
        if parents[u] >= 0:
            nsub[parents[u]] += nsub[u]
    return order, pre, nsub


def _as_index(x, name: str) -> torch.Tensor:
    t = torch.as_tensor(x).detach().to("cpu")
    if t.dim() != 1 or (t.numel() and (t.dtype.is_floating_point or t.dtype == torch.bool)):
        raise ValueError(f"{name} must be a 1-D sequence of integers, got {tuple(t.shape)} {t.dtype}")
    return t.long()


def _choose_split(n_tokens: int, n_q: int, g: int, h_kv: int, block_m: int, block_n: int, sms: int) -> int:
    """Split length for DeFT-Flatten: enough items for ~2 waves, but partials (n_splits x n_q x h x d fp32,
    written and read once) at most ~ the KV bytes (n_tokens x h_kv x d x 2 x 2 for bf16)."""
    tiles = max(1, math.ceil(n_q * g / block_m))
    by_par = math.ceil(2 * sms / (h_kv * tiles))
    by_io = max(1, n_tokens // max(1, n_q * g))
    splits = max(1, min(by_par, by_io, math.ceil(n_tokens / block_n)))
    return max(block_n, math.ceil(math.ceil(n_tokens / splits) / block_n) * block_n)


def plan_deft(parents, node_slots, query_node, query_seen=None, *, num_heads: int, num_kv_heads: int,
              num_slots: int, strategy: str = "flatten", split_len: int | None = None, block_n: int = BLOCK_N,
              device=None, num_sms: int | None = None) -> DeftPlan:
    """QKV preparation (Alg. 3): group the tree's KV with the queries that share it.

    parents [n_nodes] (-1: a root); node_slots: per node, the pool slots of its tokens in order (the token-level
    page table); query_node [n_q]; query_seen [n_q]: how many leading tokens of its own node each query sees
    (None: all; a query at offset j of a multi-token node sees j + 1). Queries see all tokens of their ancestors.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16 (tl.dot), got {block_n}")
    if split_len is not None and split_len <= 0:
        raise ValueError(f"split_len must be positive, got {split_len}")
    parents = [int(p) for p in _as_index(parents, "parents")]
    n_nodes = len(parents)
    if len(node_slots) != n_nodes:
        raise ValueError(f"node_slots has {len(node_slots)} entries for {n_nodes} nodes in parents")
    node_slots = [_as_index(s, f"node_slots[{i}]") for i, s in enumerate(node_slots)]
    order, pre, nsub = _dfs(parents)
    lens = torch.tensor([s.numel() for s in node_slots], dtype=torch.long)
    flat = torch.cat([node_slots[u] for u in order]) if n_nodes else torch.zeros(0, dtype=torch.long)
    n_tok = flat.numel()
    if n_tok and (int(flat.min()) < 0 or int(flat.max()) >= num_slots):
        raise ValueError(f"node_slots (the page table) must hold slots in [0, {num_slots}), got "
                         f"[{int(flat.min())}, {int(flat.max())}]")
    if torch.unique(flat).numel() != n_tok:
        raise ValueError("node_slots (the page table): a pool slot is used by two tokens of the tree")
    start = torch.zeros(n_nodes, dtype=torch.long)
    ordered = torch.tensor(order, dtype=torch.long)
    start[ordered] = torch.cumsum(lens[ordered], 0) - lens[ordered]
    qn = _as_index(query_node, "query_node")
    n_q = qn.numel()
    if n_q and (int(qn.min()) < 0 or int(qn.max()) >= n_nodes):
        raise ValueError(f"query_node must index the {n_nodes} nodes, got {qn.tolist()}")
    seen = lens[qn] if query_seen is None else _as_index(query_seen, "query_seen")
    if seen.numel() != n_q or (n_q and ((seen < 0) | (seen > lens[qn])).any()):
        raise ValueError("query_seen must give, for each query, 0 <= seen <= the length of its node")
    g = num_heads // num_kv_heads
    sms = num_sms or (_launch.sm_count(torch.device(device))
                      if device is not None and torch.device(device).type == "cuda" else 132)

    # Each query's visible tokens as flat intervals: every proper ancestor whole, its own node's first `seen`.
    anc: list[list[int]] = [[] for _ in range(n_nodes)]
    for u in order:
        p = parents[u]
        if p >= 0:
            anc[u] = anc[p] + [p]
    intervals = []                                                 # (query, first token, end token)
    for i, u in enumerate(qn.tolist()):
        intervals += [(i, int(start[a]), int(start[a] + lens[a])) for a in anc[u]]
        intervals.append((i, int(start[u]), int(start[u] + seen[i])))
    iv_q, iv_lo, iv_hi = torch.tensor(intervals, dtype=torch.long).reshape(-1, 3).unbind(1)
    keep = iv_hi > iv_lo
    iv_q, iv_lo, iv_hi = iv_q[keep], iv_lo[keep], iv_hi[keep]

    if strategy == "qguided":
        return _plan_qguided(flat, iv_q, iv_lo, iv_hi, n_q, g, num_heads, num_kv_heads, num_slots, split_len,
                             block_n, sms, device)
    # KV groups: ranges of the flattened tree that partition it.
    bm_est = _block_m(n_q, g)
    s_len = split_len or _choose_split(n_tok, n_q, g, num_kv_heads, bm_est, block_n, sms)
    node_ranges = [(int(start[u]), int(start[u] + lens[u])) for u in order if lens[u] > 0]
    if strategy == "flatten":
        bounds = list(range(0, n_tok, s_len))
    elif strategy == "node":
        bounds = [a for a, _ in node_ranges]
    else:
        bounds = [c for a, b in node_ranges for c in range(a, b, s_len)]
    gb = torch.tensor(bounds + [n_tok], dtype=torch.long)
    # Group-query incidence: an interval [lo, hi) touches groups group(lo) .. group(hi - 1).
    g_lo = torch.searchsorted(gb, iv_lo, right=True) - 1
    g_hi = torch.searchsorted(gb, iv_hi - 1, right=True) - 1
    cnt = g_hi - g_lo + 1
    rep_q = torch.repeat_interleave(iv_q, cnt)
    rep_g = torch.repeat_interleave(g_lo, cnt) + torch.arange(int(cnt.sum())) - torch.repeat_interleave(
        torch.cumsum(cnt, 0) - cnt, cnt)
    # Queries in depth-first order of their position, so that a tile holds neighbouring branches.
    qrank = torch.empty(n_q, dtype=torch.long)
    qrank[torch.argsort(start[qn] + seen, stable=True)] = torch.arange(n_q)
    key = torch.unique(rep_g * max(n_q, 1) + qrank[rep_q])           # sorted: group-major, then by rank
    pg, pr = key // max(n_q, 1), key % max(n_q, 1)
    q_of_rank = torch.argsort(qrank)
    pq = q_of_rank[pr]
    n_groups = gb.numel() - 1
    per_group = torch.bincount(pg, minlength=n_groups)
    block_m = _block_m(int(per_group.max()) if pg.numel() else 1, g)
    qt = min(64, block_m // g) if g <= block_m else 1
    tiles = (per_group + qt - 1) // qt
    tile_base = torch.cumsum(tiles, 0) - tiles
    pos = torch.arange(pg.numel()) - (torch.cumsum(per_group, 0) - per_group)[pg]
    p_item, p_slot = tile_base[pg] + pos // qt, pos % qt
    n_items = int(tiles.sum())
    item_group = torch.repeat_interleave(torch.arange(n_groups), tiles)
    item_start, item_len = gb[item_group], gb[item_group + 1] - gb[item_group]
    item_q = torch.full((n_items, qt), -1, dtype=torch.long)
    item_q[p_item, p_slot] = pq
    item_mask, masks = _bit_masks(item_start, item_len, item_q, qn, seen, ordered, lens, start, pre, nsub)
    return _finish(strategy, n_q, num_heads, num_kv_heads, num_slots, block_m, block_n, qt, s_len, flat, item_start,
                   item_len, item_q, item_mask, masks, pq, p_item, p_slot * g, g, device)


def _bit_masks(item_start, item_len, item_q, qn, seen, ordered, lens, start, pre, nsub):
    """Bit causal masks (Alg. 3 GetBitMask): per token of each item one int64, bit i set iff tile query i sees
    it: the token's node is an ancestor-or-self of the query's node (preorder interval test) and, inside the
    query's own node, the token's offset < seen. Items every tile query sees whole get none (offset -1).
    Returns (item_mask [I] offsets into masks, masks [M] int64)."""
    n_items, qt = item_q.shape
    n_tok = int(lens.sum())
    tok_node = torch.repeat_interleave(ordered, lens[ordered])
    pre_t, nsub_t = torch.tensor(pre)[tok_node], torch.tensor(nsub)[tok_node]
    off_t = torch.arange(n_tok) - start[tok_node]
    pre_q = torch.tensor(pre)[qn] if qn.numel() else torch.zeros(0, dtype=torch.long)
    item_mask = torch.full((n_items,), -1, dtype=torch.long)
    masks, m_len, i0 = [], 0, 0
    bit = torch.ones(qt, dtype=torch.long) << torch.arange(qt)
    while i0 < n_items:                      # in batches of items, to bound the [tokens, qt] temporaries
        i1, budget = i0, 0
        while i1 < n_items and (i1 == i0 or budget + int(item_len[i1]) * qt <= (1 << 22)):
            budget += int(item_len[i1]) * qt
            i1 += 1
        il = item_len[i0:i1]
        it = torch.repeat_interleave(torch.arange(i0, i1), il)
        tok = item_start[it] + torch.arange(int(il.sum())) - torch.repeat_interleave(torch.cumsum(il, 0) - il, il)
        qq = item_q[it]                                                   # [T, qt]
        valid = qq >= 0
        qs = qq.clamp(min=0)
        vis = ((pre_t[tok, None] <= pre_q[qs]) & (pre_q[qs] < pre_t[tok, None] + nsub_t[tok, None])
               & ((tok_node[tok, None] != qn[qs]) | (off_t[tok, None] < seen[qs])) & valid)
        dense = torch.zeros(i1 - i0, dtype=torch.long).index_add_(0, it - i0, (~(vis | ~valid)).any(1).long()) == 0
        bits = (vis.long() * bit).sum(1)                                  # distinct bits: the sum is the OR
        ends = torch.cumsum(il, 0).tolist()
        for j in (~dense).nonzero().flatten().tolist():                   # only partly visible ranges keep one
            item_mask[i0 + j] = m_len
            masks.append(bits[ends[j] - int(il[j]):ends[j]])
            m_len += int(il[j])
        i0 = i1
    return item_mask, torch.cat(masks) if masks else torch.zeros(1, dtype=torch.long)


def _block_m(queries: int, g: int) -> int:
    """Rows of a tile: the queries' heads, a power of two >= 16 (tl.dot), <= 64 queries (one int64 mask)."""
    cap = max(min(MAX_BLOCK_M, 64 * g), 1 << (g - 1).bit_length(), 16)
    return min(cap, max(16, 1 << max(0, (queries * g - 1).bit_length())))


def _plan_qguided(flat, iv_q, iv_lo, iv_hi, n_q, g, h, h_kv, num_slots, split_len, block_n, sms, device):
    """Q-guided grouping: each query's own copy of its path's slot list, split in `split_len` chunks (no masks)."""
    ln = iv_hi - iv_lo
    tok = torch.repeat_interleave(iv_lo, ln) + torch.arange(int(ln.sum())) - torch.repeat_interleave(
        torch.cumsum(ln, 0) - ln, ln)
    slots = flat[tok]
    path_len = torch.zeros(n_q, dtype=torch.long).index_add_(0, iv_q, ln)
    if split_len is None:
        per_q = max(1, math.ceil(2 * sms / max(1, n_q * h_kv)))
        longest = max(1, int(path_len.max())) if n_q else 1
        split_len = max(block_n, math.ceil(math.ceil(longest / per_q) / block_n) * block_n)
    chunks = (path_len + split_len - 1) // split_len
    n_items = int(chunks.sum())
    item_qid = torch.repeat_interleave(torch.arange(n_q), chunks)
    k = torch.arange(n_items) - torch.repeat_interleave(torch.cumsum(chunks, 0) - chunks, chunks)
    path_start = torch.cumsum(path_len, 0) - path_len
    item_start = path_start[item_qid] + k * split_len
    item_len = torch.minimum(path_len[item_qid] - k * split_len, torch.tensor(split_len))
    return _finish("qguided", n_q, h, h_kv, num_slots, _block_m(1, g), block_n, 1, split_len, slots, item_start,
                   item_len, item_qid[:, None], torch.full((n_items,), -1, dtype=torch.long),
                   torch.zeros(1, dtype=torch.long), item_qid, torch.arange(n_items), torch.zeros(n_items, dtype=torch.long),
                   g, device)


def _finish(strategy, n_q, h, h_kv, num_slots, block_m, block_n, qt, split_len, slots, item_start, item_len, item_q,
            item_mask, masks, pair_q, pair_item, pair_row, g, device):
    """Partial-buffer rows of the items, phase-2 lists (each query's partial rows, CSR), the device tensors."""
    rows = torch.bincount(pair_item, minlength=item_start.numel()) * g          # real rows of each item's tile
    item_row = torch.cumsum(rows, 0) - rows
    ent = item_row[pair_item] + pair_row
    order = torch.argsort(pair_q * max(1, item_start.numel()) + pair_item)
    q_ptr = torch.zeros(n_q + 1, dtype=torch.long)
    q_ptr[1:] = torch.cumsum(torch.bincount(pair_q, minlength=n_q), 0)
    dev = torch.device("cpu") if device is None else torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    i32 = dict(dtype=torch.int32, device=dev)
    return DeftPlan(strategy, n_q, h, h_kv, num_slots, block_m, block_n, qt, split_len,
                    slots.to(**i32), item_start.to(**i32), item_len.to(**i32), item_q.to(**i32).contiguous(),
                    item_mask.to(dev), masks.to(dev), item_row.to(dev), q_ptr.to(**i32), ent[order].to(dev))


if triton is not None:
    @triton.jit
    def _deft_partial_kernel(Q, K, V, SLOTS, ITEM_START, ITEM_LEN, ITEM_Q, ITEM_MASK, MASKS, ITEM_ROW, PO, PL,
                             sqn, sqh, skn, skh, svn, svh, TOTAL_ROWS, scale_log2,
                             G: tl.constexpr, QT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             D: tl.constexpr, PREC: tl.constexpr):
        # Phase 1 (Alg. 4 lines 9-13): program (item, kv head) -> partial (o, lse) of the item's query tile over
        # its KV range; the range is read once for all QT queries x G heads of the tile.
        item, kh = tl.program_id(0), tl.program_id(1)
        start = tl.load(ITEM_START + item)
        n_tok = tl.load(ITEM_LEN + item)
        moff = tl.load(ITEM_MASK + item)
        has_mask = moff >= 0
        rows = tl.arange(0, BLOCK_M)
        slot, j = rows // G, rows % G                  # row = tile query slot * G + head in the KV group
        qid = tl.load(ITEM_Q + item * QT + slot, mask=slot < QT, other=-1)
        row_ok = qid >= 0
        dims = tl.arange(0, D)
        q = tl.load(Q + qid[:, None] * sqn + (kh * G + j)[:, None] * sqh + dims[None, :], mask=row_ok[:, None],
                    other=0.0)
        shift = slot.to(tl.int64)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for n0 in range(0, n_tok, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            col_ok = cols < n_tok
            # The page table: token -> pool slot (int64: pools past 2^31 elements).
            kv = tl.load(SLOTS + start + cols, mask=col_ok, other=0).to(tl.int64)
            kb = tl.load(K + kv[:, None] * skn + kh * skh + dims[None, :], mask=col_ok[:, None], other=0.0)
            vb = tl.load(V + kv[:, None] * svn + kh * svh + dims[None, :], mask=col_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(kb), input_precision=PREC) * scale_log2          # log2 domain
            # Bit causal mask of a partly visible range; a fully visible one (moff = -1) loads nothing (all ones):
            # no branch in the loop, so that it stays software-pipelined.
            bits = tl.load(MASKS + moff + cols, mask=col_ok & has_mask, other=-1)
            vis = (((bits[None, :] >> shift[:, None]) & 1) != 0) & col_ok[None, :] & row_ok[:, None]
            m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, tl.where(vis, s, float("-inf")), vb, PREC)
        o, lse = softmax_finish(acc, m_i, l_i)
        base = kh.to(tl.int64) * TOTAL_ROWS + tl.load(ITEM_ROW + item) + rows      # valid rows come first
        tl.store(PO + base[:, None] * D + dims[None, :], o, mask=row_ok[:, None])
        tl.store(PL + base, lse, mask=row_ok)

    @triton.jit
    def _deft_reduce_kernel(PO, PL, Q_PTR, Q_ENT, O, LSE, son, soh, TOTAL_ROWS, H,
                            G: tl.constexpr, BLOCK_E: tl.constexpr, D: tl.constexpr):
        # Phase 2 (Alg. 4 lines 16-28): program (query, head) merges the partials of the items holding the query.
        qi, hh = tl.program_id(0), tl.program_id(1)
        kh, j = hh // G, hh % G
        e0 = tl.load(Q_PTR + qi)
        e1 = tl.load(Q_PTR + qi + 1)
        dims = tl.arange(0, D)
        m_i = tl.max(tl.full([BLOCK_E], float("-inf"), tl.float32), 0)
        l_i = tl.sum(tl.zeros([BLOCK_E], tl.float32), 0)
        acc = tl.zeros([D], tl.float32)
        for e in range(e0, e1, BLOCK_E):
            es = e + tl.arange(0, BLOCK_E)
            ok = es < e1
            idx = kh.to(tl.int64) * TOTAL_ROWS + tl.load(Q_ENT + es, mask=ok, other=0) + j
            lse = tl.load(PL + idx, mask=ok, other=float("-inf"))
            o = tl.load(PO + idx[:, None] * D + dims[None, :], mask=ok[:, None], other=0.0)
            m_new = tl.maximum(m_i, tl.max(lse, 0))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            w = tl.exp(lse - m_ref)
            alpha = tl.exp(m_i - m_ref)
            l_i = l_i * alpha + tl.sum(w, 0)
            acc = acc * alpha + tl.sum(o * w[:, None], 0)
            m_i = m_new
        ok_row = l_i > 0
        out = acc / tl.where(ok_row, l_i, 1.0)
        m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
        tl.store(O + qi * son + hh * soh + dims, out.to(O.dtype.element_ty))
        tl.store(LSE + qi * H + hh, tl.where(ok_row, m_fin + tl.log(tl.where(ok_row, l_i, 1.0)), float("-inf")))


def _check(q, k_pool, v_pool, plan):
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be [n_q, h, d], got {getattr(q, 'shape', type(q))}")
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape != k_pool.shape:
            raise ValueError(f"{name} must be [num_slots, h_kv, d] like k_pool, got {getattr(t, 'shape', type(t))}")
    n_q, h, d = q.shape
    if d not in HEAD_DIMS:
        raise ValueError(f"q: head dim must be one of {HEAD_DIMS}, got {d}")
    if k_pool.shape[2] != d or h % k_pool.shape[1]:
        raise ValueError(f"k_pool {tuple(k_pool.shape)} must have q's head dim {d} and a head count dividing {h}")
    if q.dtype not in DTYPES or k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise ValueError(f"q, k_pool, v_pool must share one dtype of {DTYPES}, got {q.dtype}, {k_pool.dtype}, "
                         f"{v_pool.dtype}")
    if k_pool.device != q.device or v_pool.device != q.device or plan.slots.device != q.device:
        raise ValueError("q, k_pool, v_pool and plan must be on one device (plan.to(device))")
    if any(x.stride(-1) != 1 for x in (q, k_pool, v_pool)):
        raise ValueError("q, k_pool, v_pool need a contiguous last (head_dim) dimension")
    if (plan.n_q, plan.num_heads, plan.num_kv_heads) != (n_q, h, k_pool.shape[1]):
        raise ValueError(f"plan was built for n_q={plan.n_q}, h={plan.num_heads}, h_kv={plan.num_kv_heads}; "
                         f"got q {tuple(q.shape)}, k_pool {tuple(k_pool.shape)}")
    if plan.num_slots > k_pool.shape[0]:
        raise ValueError(f"plan: page table addresses {plan.num_slots} slots, k_pool has {k_pool.shape[0]}")
    if not available(q.device):
        raise ValueError("deft_attention needs triton and a CUDA device (or TRITON_INTERPRET=1 on CPU); "
                         "use megatron_cp_plugin.kernels.deft_reference on this machine")


def deft_attention(q, k_pool, v_pool, plan: DeftPlan, *, softmax_scale: float | None = None, out_dtype=None):
    """Tree attention of q [n_q, h, d] over the paged pool k_pool, v_pool [num_slots, h_kv, d] (no autograd).

    Returns o [n_q, h, d] (out_dtype, default q's) and lse [n_q, h] fp32 (natural log; -inf and o = 0 for a
    query that sees no token, e.g. on a rank that holds none of its path).
    """
    _check(q, k_pool, v_pool, plan)
    n_q, h, d = q.shape
    h_kv, g = k_pool.shape[1], h // k_pool.shape[1]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    o = torch.empty(n_q, h, d, device=q.device, dtype=out_dtype or q.dtype)
    lse = torch.empty(n_q, h, device=q.device, dtype=torch.float32)
    if n_q == 0:
        return o, lse
    n_items, total_rows = plan.num_items, plan.q_ent.numel() * g
    part_o = torch.empty(h_kv * total_rows, d, device=q.device, dtype=torch.float32)
    part_l = torch.empty(h_kv * total_rows, device=q.device, dtype=torch.float32)
    # fp32 stays exact (ieee: no tf32), on FMAs that need many registers: smaller key blocks. Checks and tests.
    prec, block_n = ("ieee", 16) if q.dtype == torch.float32 else ("tf32", plan.block_n)
    with torch.no_grad():
        if n_items:
            _deft_partial_kernel[(n_items, h_kv)](
                q, k_pool, v_pool, plan.slots, plan.item_start, plan.item_len, plan.item_q, plan.item_mask,
                plan.masks, plan.item_row, part_o, part_l, q.stride(0), q.stride(1), k_pool.stride(0),
                k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), total_rows, scale * 1.4426950408889634,
                G=g, QT=plan.qt, BLOCK_M=plan.block_m, BLOCK_N=block_n, D=d, PREC=prec,
                num_warps=8 if plan.block_m >= 128 else 4)
        _deft_reduce_kernel[(n_q, h)](part_o, part_l, plan.q_ptr, plan.q_ent, o, lse, o.stride(0), o.stride(1),
                                      total_rows, h, G=g, BLOCK_E=16, D=d, num_warps=4)
    return o, lse
