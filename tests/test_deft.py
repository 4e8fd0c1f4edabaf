"""DeFT (kernels/deft.py) against the fp64 tree-attention reference; the decode tree; a GPTModel run over a tree
equal to each branch run alone; DeFT over a prefix sharded on gloo. On CPU the Triton kernels run in Triton's
interpreter (tiny sizes; fp32 and fp16: the interpreter's bf16 tl.dot is broken), on GPUs compiled (bf16 too)."""
from __future__ import annotations

import os
import random

import torch

if not torch.cuda.is_available():       # before the kernel module is imported: triton.jit reads it then
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from megatron_cp_plugin.inference.tree import DecodeTree, medusa_topology  # noqa: E402
from megatron_cp_plugin.kernels import deft  # noqa: E402
from megatron_cp_plugin.kernels.deft_reference import (dense_tree_mask, flash_decoding_baseline,  # noqa: E402
                                                        medusa_tree_attention, query_paths,
                                                        tree_attention_reference)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(not deft.available(DEV), reason=(
    "SKIPPED LOUDLY: triton is not installed (pip install triton; scripts/setup.sh does), so the DeFT kernels "
    "cannot run here, not even interpreted"))
# The interpreter's numpy conversions warn once per op.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _leaves(tree):
    return [u for u in tree.nodes() if not tree.children[u]]


def random_tree(seed, n_nodes=9, max_depth=5, spare=7):
    """parents, node_slots (a shuffled page table), query_node, query_seen, num_slots: uneven node lengths
    (empty and 1-token nodes too); queries at the ends of nodes and at every token of short (speculative) nodes."""
    r = random.Random(seed)
    parents, depth = [-1], [0]
    for i in range(1, n_nodes):
        p = r.choice([j for j in range(i) if depth[j] < max_depth - 1])
        parents.append(p), depth.append(depth[p] + 1)
    lens = [r.randint(20, 70)] + [r.choice([0, 1, 1, 2, 3, 5, 17]) for _ in range(n_nodes - 1)]
    num_slots = sum(lens) + spare
    perm = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed)).tolist()
    node_slots, qn, qs, o = [], [], [], 0
    for u, n in enumerate(lens):
        node_slots.append(perm[o:o + n])
        o += n
        if n and (r.random() < 0.6 or u == n_nodes - 1):
            for j in (range(1, n + 1) if n <= 3 else [n]):
                qn.append(u), qs.append(j)
    return parents, node_slots, qn, qs, num_slots


def _data(n_q, num_slots, h, h_kv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, hh, d, generator=g).to(DEV, dtype) for n, hh in ((n_q, h), (num_slots, h_kv),
                                                                           (num_slots, h_kv)))


def _check(tree, q, k, v, strategy, **kw):
    parents, node_slots, qn, qs, num_slots = tree
    plan = deft.plan_deft(parents, node_slots, qn, qs, num_heads=q.shape[1], num_kv_heads=k.shape[1],
                          num_slots=num_slots, strategy=strategy, device=DEV, **kw)
    o, lse = deft.deft_attention(q, k, v, plan)
    ro, rl = tree_attention_reference(q, k, v, query_paths(parents, node_slots, qn, qs))
    assert o.dtype == q.dtype and o.shape == q.shape and lse.dtype == torch.float32 and lse.shape == q.shape[:2]
    err, lerr = (o.double() - ro).abs().max().item(), (lse.double() - rl).abs().max().item()
    assert err <= TOL[q.dtype] and lerr <= TOL[q.dtype], (strategy, err, lerr)
    return plan


KERNEL_CASES = [(4, 1, 64, torch.float32), (8, 2, 128, torch.float16), (2, 2, 64, torch.float16)]
if DEV.type == "cuda":
    KERNEL_CASES += [(8, 2, 128, torch.bfloat16), (32, 8, 128, torch.bfloat16), (4, 4, 64, torch.bfloat16)]


@needs_triton
@pytest.mark.parametrize("strategy", deft.STRATEGIES)
def test_random_trees_match_fp64_reference(strategy):
    for seed in range(3):
        tree = random_tree(seed)
        for i, (h, h_kv, d, dtype) in enumerate(KERNEL_CASES):
            q, k, v = _data(len(tree[2]), tree[4], h, h_kv, d, dtype, seed * 10 + i)
            # Odd seeds: short splits (many groups, masks across node boundaries); even: the automatic length.
            _check(tree, q, k, v, strategy, split_len=16 if seed % 2 else None, block_n=16)


@needs_triton
@pytest.mark.parametrize("strategy", ["flatten", "node"])
def test_token_tree_with_more_queries_than_one_tile(strategy):
    """A Medusa-topology tree of 70 tokens on a 50-token prefix: with MHA a tile holds 64 queries (bit 63 of the
    mask is used: the sign bit) and the queries of the prefix need two tiles."""
    parents = [-1] + [p + 1 for p in medusa_topology(70)]
    lens = [50] + [1] * 70
    perm = torch.randperm(160, generator=torch.Generator().manual_seed(1)).tolist()
    node_slots = [perm[sum(lens[:i]):sum(lens[:i + 1])] for i in range(len(lens))]
    tree = (parents, node_slots, list(range(1, 71)), [1] * 70, 160)
    q, k, v = _data(70, 160, 1, 1, 64, torch.float32, 3)
    plan = _check(tree, q, k, v, strategy, block_n=32)
    assert plan.qt == 64 and plan.item_q.shape[0] > len(set(plan.item_start.tolist()))   # several tiles a range


@needs_triton
def test_query_that_sees_nothing_gets_zero_and_minus_inf():
    tree = ([-1, 0], [[0, 1, 2], [3]], [0, 1, 1], [0, 1, 0], 4)   # query 0 sees nothing; query 2 only the root
    q, k, v = _data(3, 4, 2, 1, 64, torch.float32, 0)
    plan = deft.plan_deft(*tree[:4], num_heads=2, num_kv_heads=1, num_slots=4, device=DEV)
    o, lse = deft.deft_attention(q, k, v, plan)
    assert torch.isinf(lse[0]).all() and (o[0] == 0).all() and torch.isfinite(lse[1:]).all()
    ro, _ = tree_attention_reference(q, k, v, query_paths(*tree[:4]))
    assert (o.double() - ro).abs().max() <= 1e-5


def test_bad_input_raises_value_error_naming_the_argument():
    tree = ([-1, 0], [[0, 1], [2]], [1], [1])
    plan = deft.plan_deft(*tree, num_heads=4, num_kv_heads=2, num_slots=3)
    q, k = torch.randn(1, 4, 64), torch.randn(3, 2, 64)
    bad_plans = [
        (dict(parents=[-1, 5]), "parents"), (dict(parents=[1, 0]), "parents"),
        (dict(node_slots=[[0, 1], [7]]), "node_slots"), (dict(node_slots=[[0, 1], [1]]), "node_slots"),
        (dict(node_slots=[[0, 1]]), "node_slots"), (dict(query_seen=[2]), "query_seen"),
        (dict(query_node=[4]), "query_node"), (dict(strategy="bogus"), "strategy"),
        (dict(num_kv_heads=3), "num_heads"), (dict(split_len=0), "split_len"), (dict(block_n=24), "block_n")]
    for change, needle in bad_plans:
        kw = dict(parents=tree[0], node_slots=tree[1], query_node=tree[2], query_seen=tree[3], num_heads=4,
                  num_kv_heads=2, num_slots=3) | change
        with pytest.raises(ValueError, match=needle):
            deft.plan_deft(**kw)
    bad_calls = [((torch.randn(1, 4, 32), k, k), "head dim"), ((q, k, torch.randn(3, 2, 32)), "v_pool"),
                 ((q.half(), k, k), "dtype"), ((torch.randn(2, 4, 64), k, k), "plan"),
                 ((q, torch.randn(2, 2, 64), torch.randn(2, 2, 64)), "slots"), ((q[0], k, k), "q must be")]
    for args, needle in bad_calls:
        with pytest.raises(ValueError, match=needle):
            deft.deft_attention(*args, plan)


def test_decode_tree_branch_append_prune_frees_slots():
    t = DecodeTree(10)
    root = t.add_node(tokens=[1, 2, 3])
    a, b = t.branch(root, 2)
    assert t.append(a, [4, 5]) == [3, 4] and t.append(b, [6]) == [5]
    c = t.add_node(a, [7])
    assert t.path_tokens(c) == [1, 2, 3, 4, 5, 7] and _leaves(t) == [b, c] and t.ancestors(c) == [root, a]
    freed = t.prune(a)                                   # a and its child c
    assert sorted(freed) == [3, 4, 6] and len(t.free) == 10 - 4 and t.nodes() == [root, b]
    assert sorted(t.append(b, [8, 9, 10])) == [3, 4, 6]   # freed slots are reused
    with pytest.raises(ValueError, match="not in the tree"):
        t.append(c, [1])
    with pytest.raises(RuntimeError, match="KV pool full"):
        t.append(b, [0] * 4)
    d = t.add_node(b, [11])
    assert t.merge_into_parent(d) == b and t.tokens[b] == [6, 8, 9, 10, 11] and t.nodes() == [root, b]
    ids, parents, slots = t.layout()
    assert ids == [root, b] and parents == [-1, 0] and slots[1] == t.slots[b]
    assert t.paths([(b, 2)])[0].tolist() == [0, 1, 2, 5, 3]


def test_baselines_match_reference():
    parents, node_slots, qn, qs, num_slots = random_tree(4)
    q, k, v = (x.cpu() for x in _data(len(qn), num_slots, 8, 2, 64, torch.float32, 4))
    paths = query_paths(parents, node_slots, qn, qs)
    ro, _ = tree_attention_reference(q, k, v, paths)
    fd = flash_decoding_baseline(q, k, v, paths, chunk_bytes=4096)          # several query chunks
    tree_slots = torch.tensor([s for ns in node_slots for s in ns])
    med = medusa_tree_attention(q, k[tree_slots], v[tree_slots], dense_tree_mask(paths, tree_slots))
    assert (fd.double() - ro).abs().max() <= 2e-5 and (med.double() - ro).abs().max() <= 2e-5


SPEC_NEW = 8            # greedy tokens speculative decoding must reproduce


def _model(dtype):
    import warnings
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps

    from megatron_cp_plugin.inference.token_check import vary_greedy_tokens_
    from megatron_cp_plugin.megatron import CPConfig
    from megatron_cp_plugin.megatron.model import build_gpt, tiny_config
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(context_parallel_size=1)
    torch.manual_seed(0)
    cfg = tiny_config(cp_size=1, hidden=64, heads=4, groups=2, ffn=128, dtype=dtype)
    cfg.kv_channels = 64                                 # head dim 64: one the kernel runs
    model = build_gpt(cfg, CPConfig(algo="ring", cp_size=1), vocab_size=97, seq_length=256,
                      cp_group=ps.get_context_parallel_group())
    # The token-check model (inference/token_check.py): speculative == greedy below compares greedy tokens.
    return vary_greedy_tokens_(model.to(DEV).eval())


def _full_logits(model, ids):
    """The last token's logits of one branch's whole sequence, the plain way (zigzag CP = 1 wants an even
    length; a padding token after the last one does not change it under causal attention)."""
    x = torch.tensor([ids + [0] * (len(ids) % 2)], device=DEV)
    with torch.no_grad():
        return model(x, torch.arange(x.shape[1], device=DEV)[None], None)[0, len(ids) - 1].double()


def _tree_vs_branches(rank, world, backend, dtype):
    from megatron_cp_plugin.inference.token_check import variety
    from megatron_cp_plugin.inference.tree import TreeDecoder, few_shot, speculative, tot_bfs
    model = _model(dtype)
    tree = DecodeTree(300)
    dec = TreeDecoder(model, tree, backend=backend, split_len=16)
    prompt = torch.randint(0, 97, (21,), generator=torch.Generator().manual_seed(2)).tolist()
    root = tree.add_node()
    rows = [dec.step([(root, prompt)])[-1]]
    a, b, c = tree.branch(root, 3)
    step = dec.step([(a, [5, 6, 7]), (b, [8]), (c, [9, 10])])        # a multi-token node: causal inside it
    e = tree.add_node(a)
    step2 = dec.step([(e, [11]), (b, [12, 13]), (c, [14])])
    got = rows + [step[2], step2[0], step2[2], step2[3]]
    want = [_full_logits(model, tree.path_tokens(n)) for n in (root, a, e, b, c)]
    errs = [(g.double() - w).abs().max().item() for g, w in zip(got, want)]
    # The three workloads, small: speculative decoding must give greedy decoding's tokens (it is lossless).
    ids, greedy = list(prompt), []
    for _ in range(SPEC_NEW):
        greedy.append(int(_full_logits(model, ids).argmax()))
        ids.append(greedy[-1])
    t2 = DecodeTree(300)
    spec = speculative(TreeDecoder(model, t2, backend=backend), prompt, new_tokens=SPEC_NEW, t=10)
    t3 = DecodeTree(300)
    shot = few_shot(TreeDecoder(model, t3, backend=backend), prompt, branches=3, steps=2)
    t4 = DecodeTree(300)
    best = tot_bfs(TreeDecoder(model, t4, backend=backend), prompt, depth=2, width=2, branch=2, thought_len=2)
    kept = t2.nodes()
    return (errs, (spec == greedy, variety(greedy)), len(kept), len(t2.free) + len(t2.tokens[kept[0]]),
            [len(x) for x in shot.values()], len(_leaves(t4)), len(best), len(t4.free))


@pytest.mark.parametrize("backend,dtype,tol", [pytest.param("deft", torch.float32, 1e-4, marks=needs_triton),
                                               ("reference", torch.float64, 1e-7)])
def test_gpt_over_a_tree_equals_each_branch_alone(pools, backend, dtype, tol):
    errs, spec_ok, spec_nodes, spec_slots, shot, tot_leaves, best_len, tot_free = pools(1).run(
        _tree_vs_branches, backend, dtype)[0]
    # fp64 model: the plain path's attention keeps an fp32 lse, so ~1e-8 is its floor, not the tree's.
    assert max(errs) <= tol, errs
    # Speculative: greedy's tokens (which vary: equal constant tokens would prove nothing), the accepted path
    # folded into one node, rejected drafts pruned and their slots free again.
    assert spec_ok == (True, None) and spec_nodes == 1 and spec_slots == 300, spec_ok
    assert shot == [3, 3, 3]
    # ToT-BFS: prompt 21; depth 1: 2 thoughts of 2 tokens kept; depth 2: 4 grown, 2 kept, 2 pruned (freed).
    assert tot_leaves == 2 and best_len == 21 + 2 + 2 and tot_free == 300 - 21 - 2 * 2 - 2 * 2


def _sharded(rank, world, strategy):
    from megatron_cp_plugin.inference.tree import deft_attention_sharded
    results = []
    for seed in range(2):
        parents, node_slots, qn, qs, num_slots = random_tree(20 + seed, n_nodes=7)
        q, k, v = _data(len(qn), num_slots, 8, 2, 64, torch.float32, seed)
        ro, rl = tree_attention_reference(q, k, v, query_paths(parents, node_slots, qn, qs))
        # Each node's tokens cut into `world` contiguous pieces at random points (the prefix spread over all
        # ranks, some pieces empty); rank r keeps piece r in its own pool (here: the same pool, its slots only).
        rng = random.Random(seed)
        local, piece = [], []
        for sl in node_slots:
            cuts = sorted(rng.randint(0, len(sl)) for _ in range(world - 1))
            lo, hi = ([0] + cuts)[rank], (cuts + [len(sl)])[rank]
            local.append(sl[lo:hi])
            piece.append((lo, hi))
        # A query sees the tokens of its own node before its global offset: locally, those of this piece.
        local_seen = [min(max(s - piece[n][0], 0), piece[n][1] - piece[n][0]) for n, s in zip(qn, qs)]
        plan = deft.plan_deft(parents, local, qn, local_seen, num_heads=8, num_kv_heads=2, num_slots=num_slots,
                              strategy=strategy, split_len=16, block_n=16, device=q.device)
        # gloo all-gathers CPU tensors only: on GPUs both seeds take all-reduce variants.
        variants = (None, "allgather") if DEV.type == "cpu" else ("allreduce2", "allreduce3")
        o, lse = deft_attention_sharded(q, k, v, plan, variant=variants[seed])
        results.append(max((o.double() - ro).abs().max().item(), (lse.double() - rl).abs().max().item()))
    return max(results)


@needs_triton
@pytest.mark.parametrize("world,strategy", [(2, "flatten"), (3, "node_chunk")])
def test_sharded_prefix_merges_to_the_reference(pools, world, strategy):
    assert max(pools(world).run(_sharded, strategy)) <= 2e-5


@pytest.mark.skipif(DEV.type != "cuda", reason="realistic sizes need the compiled kernels (GPU); the interpreter "
                                               "covers the same code paths at tiny sizes above")
@pytest.mark.parametrize("kv_heads", (8, 32))
def test_gpu_benchmark_shapes_bf16(kv_heads):
    from megatron_cp_plugin.bench.deft import fewshot_shape, make_case, spec_shape, tot_shape
    for shape in (fewshot_shape(1000, 20, 100), tot_shape(800, 3, 10, 3, 200), spec_shape(1000, 64)):
        c = make_case(shape, h=32, h_kv=kv_heads, d=128, dtype=torch.bfloat16, device=DEV)
        paths = query_paths(c["parents"], c["node_slots"], c["qn"], c["qs"])
        ro, rl = tree_attention_reference(c["q"], c["k"], c["v"], [p.to(DEV) for p in paths], dtype=torch.float32)
        for strategy in deft.STRATEGIES:
            plan = deft.plan_deft(c["parents"], c["node_slots"], c["qn"], c["qs"], num_heads=32,
                                  num_kv_heads=kv_heads, num_slots=c["num_slots"], strategy=strategy, device=DEV)
            o, lse = deft.deft_attention(c["q"], c["k"], c["v"], plan)
            assert (o.double() - ro).abs().max() <= 2e-2 and (lse.double() - rl).abs().max() <= 2e-2, strategy


def test_bench_memory_is_decided_from_the_shape_and_a_workload_that_does_not_fit_is_a_row(monkeypatch, tmp_path):
    import json

    from megatron_cp_plugin.bench import _common
    from megatron_cp_plugin.bench.deft import case_bytes, fewshot_shape, main, path_lengths, spec_shape, tot_shape
    from megatron_cp_plugin.bench.decode_model import MARGIN_BYTES

    for shape in (fewshot_shape(64, 3, 8), tot_shape(40, 3, 2, 2, 6), spec_shape(80, 8)):
        parents, lens, qn, qs = shape
        slots, o = [], 0
        for n in lens:
            slots.append(list(range(o, o + n)))
            o += n
        assert path_lengths(shape) == [p.numel() for p in query_paths(parents, slots, qn, qs)]
    # spec t = 256 on a 6000-token prefix, the default bench's largest: gather + SDPA's 1 GiB chunks of gathered
    # K, V (counted twice) dominate Medusa's [32 heads, 256 queries, 6256 keys] scores (0.5 GB).
    big = case_bytes(spec_shape(6000, 256), h=32, h_kv=8, d=128, e=2)
    assert 2 * 2**30 < big - MARGIN_BYTES < 4 * 2**30
    if not deft.available(torch.device("cpu")) or DEV.type != "cpu":
        return                                          # the run below: the CPU smoke sizes (interpreter)
    monkeypatch.setattr(_common, "free_bytes", lambda device: 2**20)     # 1 MiB free: nothing fits
    main(["--tiny", "--workloads", "spec", "fewshot", "--out", str(tmp_path / "deft")])
    rows = json.loads((tmp_path / "deft.json").read_text())["rows"]
    assert [r["workload"] for r in rows] == ["fewshot b=3", "spec t=8"]
    assert all(r["not_run"].startswith("not run: needs 1.0 GiB of 0.0 GiB free on") for r in rows), rows
