"""Tree-structured decoding with DeFT (deft.txt, Sec. 3, A.1): a decode tree over a paged KV cache, a
core-attention hook that runs a Megatron GPTModel over one tree step with DeFT, the paper's three workloads,
and DeFT over a KV cache sharded across a context-parallel group.

    tree = DecodeTree(num_slots=4096)                   # topology + token-level page table + per-layer pools
    dec = TreeDecoder(model, tree)                      # model: build_gpt(...) with CP size 1
    root = tree.add_node()
    logits = dec.step([(root, prompt_ids)])             # [n_new, vocab]: every new token is a query
    a, b = tree.branch(root, 2)
    logits = dec.step([(a, [t1]), (b, [t2])])           # one forward, all branches; DeFT in every layer
    tree.prune(b)                                       # frees b's subtree's slots
A step appends its tokens to their nodes; in every layer the hook writes their K, V into the pool slots and
runs DeFT, each new token seeing its node's ancestors and its own node up to itself (causal inside a node).
"""
from __future__ import annotations

import heapq
import random

import torch

from ..kernels.deft import DeftPlan, deft_attention, plan_deft
from ..kernels.deft_reference import query_paths, tree_attention_reference
from .hooks import PositionRope, swapped


class DecodeTree:
    """Nodes (ids never reused) with token ids and pool slots; a free list of slots; K, V pools per layer."""

    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))          # a stack: slots come out 0, 1, 2, ...
        self.parent: dict[int, int] = {}
        self.children: dict[int, list[int]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.slots: dict[int, list[int]] = {}
        self.pools: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._next = 0

    def _check(self, node: int) -> None:
        if node not in self.parent:
            raise ValueError(f"node {node} is not in the tree (pruned, or never added)")

    def add_node(self, parent: int = -1, tokens=()) -> int:
        """A new node under `parent` (-1: a root) holding `tokens`; returns its id."""
        if parent != -1:
            self._check(parent)
        node, self._next = self._next, self._next + 1
        self.parent[node], self.children[node], self.tokens[node], self.slots[node] = parent, [], [], []
        if parent != -1:
            self.children[parent].append(node)
        self.append(node, tokens)
        return node

    def branch(self, node: int, k: int) -> list[int]:
        """k empty children of `node`."""
        return [self.add_node(node) for _ in range(k)]

    def append(self, node: int, tokens) -> list[int]:
        """Append token ids to `node`; returns the pool slots given to them."""
        self._check(node)
        tokens = [int(t) for t in tokens]
        if len(tokens) > len(self.free):
            raise RuntimeError(f"KV pool full: {len(tokens)} slots asked, {len(self.free)} free of {self.num_slots}")
        new = [self.free.pop() for _ in tokens]
        self.tokens[node] += tokens
        self.slots[node] += new
        return new

    def prune(self, node: int) -> list[int]:
        """Remove `node` and its subtree; their slots go back to the free list (returned)."""
        self._check(node)
        if self.parent[node] != -1:
            self.children[self.parent[node]].remove(node)
        freed, stack = [], [node]
        while stack:
            u = stack.pop()
            stack += self.children.pop(u)
            freed += self.slots.pop(u)
            del self.tokens[u], self.parent[u]
        self.free += freed[::-1]
        return freed

    def merge_into_parent(self, node: int) -> int:
        """Fold an only child into its parent (paged: only slot indices move); returns the parent."""
        self._check(node)
        p = self.parent[node]
        if p == -1 or self.children[p] != [node]:
            raise ValueError(f"node {node} must be the only child of a parent to merge into it")
        self.tokens[p] += self.tokens.pop(node)
        self.slots[p] += self.slots.pop(node)
        self.children[p] = self.children.pop(node)
        for c in self.children[p]:
            self.parent[c] = p
        del self.parent[node]
        return p

    def nodes(self) -> list[int]:
        return sorted(self.parent)

    def ancestors(self, node: int) -> list[int]:
        """Root first, `node` excluded."""
        self._check(node)
        out, a = [], self.parent[node]
        while a != -1:
            out.append(a)
            a = self.parent[a]
        return out[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [t for a in self.ancestors(node) + [node] for t in self.tokens[a]]

    def layout(self):
        """(node ids, parents [n] as indices into them, node_slots): the arrays plan_deft takes."""
        ids = self.nodes()
        index = {u: i for i, u in enumerate(ids)}
        return ids, [index.get(self.parent[u], -1) for u in ids], [self.slots[u] for u in ids]

    def plan(self, queries, *, num_heads: int, num_kv_heads: int, **kw) -> DeftPlan:
        """DeFT plan for queries [(node, seen)] (seen: leading tokens of its node the query sees)."""
        ids, parents, node_slots = self.layout()
        index = {u: i for i, u in enumerate(ids)}
        return plan_deft(parents, node_slots, [index[u] for u, _ in queries], [s for _, s in queries],
                         num_heads=num_heads, num_kv_heads=num_kv_heads, num_slots=self.num_slots, **kw)

    def paths(self, queries) -> list[torch.Tensor]:
        """Each query's pool slots, root first (the reference's and the Q-guided baselines' input)."""
        ids, parents, node_slots = self.layout()
        index = {u: i for i, u in enumerate(ids)}
        return query_paths(parents, node_slots, [index[u] for u, _ in queries], [s for _, s in queries])

    def pool(self, layer: int, h_kv: int, d: int, dtype, device):
        """Layer `layer`'s K, V pools [num_slots, h_kv, d], allocated on first use."""
        if layer not in self.pools:
            self.pools[layer] = tuple(torch.zeros(self.num_slots, h_kv, d, dtype=dtype, device=device)
                                      for _ in range(2))
        return self.pools[layer]


def deft_attention_sharded(q, k_pool, v_pool, plan: DeftPlan, *, group=None, variant: str | None = None,
                           softmax_scale: float | None = None):
    """DeFT over a tree whose KV is sharded over `group` (e.g. a long shared prefix cut into P pieces).

    Every rank holds the same queries q [n_q, h, d] and tree topology; its plan covers only its own tokens
    (node_slots into its own pool, query_seen counting its own tokens of the query's node). Each rank runs
    DeFT on its part, then tree_merge (Alg. 3 lines 3-6 of tree-attention.txt) combines the partials.
    Returns (o [n_q, h, d] in q's dtype, lse [n_q, h] fp32), the same on every rank.
    """
    from ..algos.tree_decode import DEFAULT_VARIANT, tree_merge

    o, lse = deft_attention(q, k_pool, v_pool, plan, softmax_scale=softmax_scale, out_dtype=torch.float32)
    o, lse = tree_merge(o[None], lse.t().contiguous()[None], group=group, variant=variant or DEFAULT_VARIANT)
    return o[0].to(q.dtype), lse[0].t()


class _DeftCore(torch.nn.Module):
    """Stands in for a layer's core attention during a tree step: stores the step's K, V, attends with DeFT."""

    def __init__(self, inner, layer: int, decoder: "TreeDecoder"):
        super().__init__()
        self.inner, self.layer, self.decoder = inner, layer, decoder

    def forward(self, query, key, value, attention_mask=None, **_):
        """query [s, 1, h, d], key, value [s, 1, h_kv, d] (RoPE applied) -> [s, 1, h * d]."""
        dec = self.decoder
        k_pool, v_pool = dec.tree.pool(self.layer, key.shape[2], key.shape[3], key.dtype, key.device)
        k_pool[dec._new_slots], v_pool[dec._new_slots] = key[:, 0], value[:, 0]
        scale = getattr(self.inner, "softmax_scale", None)
        q = query[:, 0]
        if dec.backend == "reference":
            o = tree_attention_reference(q, k_pool, v_pool, dec._paths, softmax_scale=scale, dtype=q.dtype)[0]
        else:
            o = deft_attention(q.contiguous(), k_pool, v_pool, dec._plan, softmax_scale=scale)[0]
        return o.reshape(query.shape[0], 1, -1)


class TreeDecoder:
    """Runs a GPTModel (CP size 1, batch 1) over tree steps with DeFT in every layer's core attention.

    backend: "deft" (Triton; GPUs or TRITON_INTERPRET=1) or "reference" (plain torch, any dtype, any machine).
    """

    def __init__(self, model, tree: DecodeTree, *, strategy: str = "flatten", backend: str = "deft",
                 split_len: int | None = None):
        if backend not in ("deft", "reference"):
            raise ValueError(f"backend must be 'deft' or 'reference', got {backend!r}")
        self.model, self.tree, self.strategy, self.backend, self.split_len = model, tree, strategy, backend, split_len
        cfg = model.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads
        self._plan = self._paths = self._new_slots = None

    @torch.no_grad()
    def step(self, feeds) -> torch.Tensor:
        """feeds: [(node, token ids)]. Appends the tokens and runs them in one forward; returns [n_new, vocab] fp32."""
        tree, dev = self.tree, next(self.model.parameters()).device
        ids, pos, slots, queries = [], [], [], []
        for node, toks in feeds:
            before = len(tree.path_tokens(node))
            own = len(tree.tokens[node])
            slots += tree.append(node, toks)
            for i, t in enumerate(toks):
                ids.append(int(t)), pos.append(before + i), queries.append((node, own + i + 1))
        if not ids:
            raise ValueError("feeds: no tokens to run")
        self._new_slots = torch.tensor(slots, dtype=torch.long, device=dev)     # one copy a step, not a layer
        if self.backend == "reference":
            self._paths = [p.to(dev) for p in tree.paths(queries)]
        else:
            self._plan = tree.plan(queries, num_heads=self.heads, num_kv_heads=self.kv_heads, strategy=self.strategy,
                                   split_len=self.split_len, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        self.model.eval()
        core = lambda c, i: _DeftCore(c, getattr(c, "layer_number", i + 1), self)  # noqa: E731
        with swapped(self.model, core=core, rope=lambda r: PositionRope(r, positions)):
            logits = self.model(torch.tensor([ids], device=dev), positions[None], None)
        return logits[0].float()


def medusa_topology(t: int, *, top_k: int = 10, max_depth: int = 5, decay: float = 0.6) -> list[int]:
    """Parents (-1: the prefix) of a Medusa-style sparse token tree of t nodes, parents first: best-first by
    the assumed acceptance of a path, a rank-r candidate of Medusa head d (depth d >= 1) accepted with
    decay**(d - 1) / (r + 1) (Cai et al., 2024, Sec. 2.1.2 builds its trees so, from measured accuracies)."""
    parents, depth = [], []
    heap = [(-1.0, 0, -1, 0)]                                      # (-path probability, tiebreak, parent, rank)
    tick = 1
    while heap and len(parents) < t:
        neg, _, par, rank = heapq.heappop(heap)
        node, d = len(parents), (depth[par] if par >= 0 else 0) + 1
        parents.append(par), depth.append(d)
        if rank + 1 < top_k:                                       # the next sibling
            heapq.heappush(heap, (neg * (rank + 1) / (rank + 2), tick, par, rank + 1))
            tick += 1
        if d < max_depth:                                          # the first child
            heapq.heappush(heap, (neg * decay ** d, tick, node, 0))
            tick += 1
    return parents


def few_shot(decoder: TreeDecoder, prompt, *, branches: int, steps: int) -> dict[int, list[int]]:
    """Few-shot prompting: one prompt, `branches` children started from its top-`branches` next tokens, then
    greedy in lockstep (one forward per step for all branches). Returns {branch node: its tokens}."""
    tree = decoder.tree
    root = tree.add_node()
    last = decoder.step([(root, list(prompt))])[-1]
    kids = tree.branch(root, branches)
    toks = {c: [int(t)] for c, t in zip(kids, last.topk(branches).indices)}
    for _ in range(steps):
        rows = decoder.step([(c, [toks[c][-1]]) for c in kids])
        for c, row in zip(kids, rows):
            toks[c].append(int(row.argmax()))
    return toks


def tot_bfs(decoder: TreeDecoder, prompt, *, depth: int, width: int, branch: int, thought_len: int) -> list[int]:
    """Multi-step reasoning, ToT-BFS: every kept state grows `branch` thoughts of `thought_len` tokens in lockstep;
    the `width` best by mean log-probability survive, the rest are pruned (slots freed). Returns the best path."""
    tree = decoder.tree
    root = tree.add_node()
    rows = {root: decoder.step([(root, list(prompt))])[-1]}
    frontier = [root]
    for _ in range(depth):
        kids, score, last = [], {}, {}
        for s in frontier:
            for c, tok in zip(tree.branch(s, branch), rows[s].topk(branch).indices):
                kids.append(c)
                score[c], last[c] = float(torch.log_softmax(rows[s], -1)[tok]), int(tok)
        for _ in range(thought_len - 1):
            out = decoder.step([(c, [last[c]]) for c in kids])
            for c, row in zip(kids, out):
                lp = torch.log_softmax(row, -1)
                last[c] = int(row.argmax())
                score[c] += float(lp[last[c]])
                rows[c] = row
        out = decoder.step([(c, [last[c]]) for c in kids])       # the thought's last token enters the cache
        rows.update(zip(kids, out))
        kept = sorted(kids, key=lambda c: -score[c])[:width]
        for c in kids:
            if c not in kept:
                tree.prune(c)
        frontier = kept
    return tree.path_tokens(frontier[0])


def speculative(decoder: TreeDecoder, prompt, *, new_tokens: int, t: int, seed: int = 0) -> list[int]:
    """Speculative decoding with a Medusa-topology token tree of t tokens: depth-1 candidates are the top-k of
    the last logits, deeper ones a random draft; one forward verifies the whole tree (causal by topology); the
    longest greedy-consistent path is kept (its slots folded into the sequence), the rest pruned. Lossless:
    the tokens equal greedy decoding's."""
    tree, rng = decoder.tree, random.Random(seed)
    seq = tree.add_node()
    row = decoder.step([(seq, list(prompt))])[-1]
    vocab = row.numel()
    parents = medusa_topology(t)
    out = []
    while len(out) < new_tokens:
        nodes, feeds = [], []
        rank = [sum(1 for q in parents[:i] if q == parents[i]) for i in range(len(parents))]
        top = row.topk(max(rank) + 1).indices.tolist()
        for i, p in enumerate(parents):
            nodes.append(tree.add_node(seq if p == -1 else nodes[p]))
            feeds.append((nodes[i], [top[rank[i]] if p == -1 else rng.randrange(vocab)]))
        rows = decoder.step(feeds)
        best, cur, cur_row = [], -1, row                          # walk: accept the child equal to argmax
        while True:
            want = int(cur_row.argmax())
            nxt = [i for i, p in enumerate(parents) if p == cur and feeds[i][1][0] == want]
            if not nxt:
                break
            cur = nxt[0]
            best.append(cur)
            cur_row = rows[cur]
        keep = set(best)
        for i, p in enumerate(parents):
            if p == -1 and i not in keep:
                tree.prune(nodes[i])
            elif i in keep:
                for c in list(tree.children[nodes[i]]):
                    if c not in {nodes[j] for j in keep}:
                        tree.prune(c)
        for i in best:                                            # paged: folding moves slot indices only
            tree.merge_into_parent(nodes[i])
        out += [feeds[i][1][0] for i in best]
        if not best:                                              # never happens with rank-0 candidates
            raise RuntimeError("speculative: the greedy token was not among the candidates")
        row = cur_row
    return out[:new_tokens]
