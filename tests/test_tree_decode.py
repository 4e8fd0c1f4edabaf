"""tree_decode against an fp64 reference of the unsharded cache, on gloo with P = 1..4, every variant."""
from __future__ import annotations

import itertools

import pytest
import torch

import megatron_cp_plugin as mcp
from megatron_cp_plugin.algos.tree_decode import COLLECTIVE_VARIANTS

NO_INTERPRETER = ("SKIPPED LOUDLY: the flash-decoding kernel cannot run interpreted on CPU here (Triton missing, or a GPU "
                  "machine, where TRITON_INTERPRET is unset and tests/test_flash_decode.py runs it compiled)")


def _reference(q, k, v, vis):
    """fp64 attention of q [b, n, h, d] over the whole cache k, v [b, S, h_kv, d], vis [b, n, S]."""
    g = q.shape[2] // k.shape[2]
    kk, vv = k.double().repeat_interleave(g, 2), v.double().repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * q.shape[-1] ** -0.5
    s = s.masked_fill(~vis[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vv)


def _split(total, world, rank, seed):
    """Uneven shard lengths summing to `total`; some ranks get none when world > 1."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randint(0, total + 1, (world - 1,), generator=g).tolist())
    if world > 2:
        cuts[0] = 0                                              # rank 0 always empty: an empty shard
    bounds = [0] + cuts + [total]
    return bounds[rank], bounds[rank + 1]


def _cases(rank, world, variant, backend=None):
    bad = []
    # The Triton split-KV kernel (interpreted on CPU) takes head dims 64/128/256 and no fp64.
    dtypes, d = ((torch.float32,), 64) if backend == "triton" else ((torch.float32, torch.float64), 16)
    for i, ((h, hk), n_q, ragged, dtype) in enumerate(itertools.product(
            ((4, 4), (8, 2)), (1, 3), (False, True), dtypes)):
        g = torch.Generator().manual_seed(100 + i)
        b, S = 2, 37
        q = torch.randn(b, n_q, h, d, generator=g).to(dtype)
        k, v = (torch.randn(b, S, hk, d, generator=g).to(dtype) for _ in range(2))
        # Global positions: sequence 0 has all S tokens, sequence 1 only its first 29 when ragged; the n_q
        # queries are the last n_q tokens of each sequence and see keys at positions <= their own.
        lens = torch.tensor([S, 29 if ragged else S])
        pos = torch.arange(S).expand(b, S).clone()
        pos[pos >= lens[:, None]] = -1
        q_pos = lens[:, None] - n_q + torch.arange(n_q)[None, :]
        vis = (pos[:, None, :] >= 0) & (pos[:, None, :] <= q_pos[:, :, None])
        ref = _reference(q, k, v, vis)
        # This rank's shard: a contiguous uneven slice, stored in reverse order (order must not matter).
        lo, hi = _split(S, world, rank, seed=i)
        sl = slice(lo, hi)
        kl, vl, pl = (t[:, sl].flip(1) for t in (k, v, pos))
        masked = n_q > 1 or ragged
        out = mcp.tree_decode(q, kl, vl, variant=variant, kv_positions=pl if masked else None,
                              q_positions=q_pos if masked else None, backend=backend)
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        if not err <= tol:
            bad.append(f"P={world} rank {rank} {variant} h={h}/{hk} n_q={n_q} ragged={ragged} {dtype}: {err:.3g}")
    assert not bad, "\n".join(bad)
    return True


@pytest.mark.parametrize("variant", COLLECTIVE_VARIANTS)   # "peer": NVLink only, tests/nccl_check.py on GPUs
@pytest.mark.parametrize("world", (1, 2, 3, 4))
def test_tree_decode_matches_fp64_reference(pools, world, variant):
    assert all(pools(world).run(_cases, variant))


@pytest.mark.parametrize("variant", ("allreduce2", "allgather"))   # allgather: the fused merge kernel too
@pytest.mark.parametrize("world", (1, 3))
def test_tree_decode_with_the_triton_kernel(pools, world, variant):
    from megatron_cp_plugin.kernels.flash_decode import available
    if not available(torch.device("cpu")):
        pytest.skip(NO_INTERPRETER)
    assert all(pools(world).run(_cases, variant, "triton"))


def _bad(rank, world, case):
    q = torch.randn(1, 1, 4, 8)
    k = v = torch.randn(1, 5, 2, 8)
    kw = {}
    if case == "q_not_replicated":
        q = torch.randn(1, 1 + rank, 4, 8)
    elif case == "heads":
        k = v = torch.randn(1, 5, 3, 8)
    elif case == "empty_everywhere":
        k = v = torch.randn(1, 0, 2, 8)
    elif case == "variant":
        kw["variant"] = "nope"
    elif case == "peer":                  # symmetric memory: not on gloo, not without a workspace
        kw["variant"] = "peer"
    mcp.tree_decode(q, k, v, **kw)
    return "no error"


@pytest.mark.parametrize("case,needle", [("q_not_replicated", "replicated"), ("heads", "heads"),
                                         ("empty_everywhere", "empty"), ("variant", "variant"),
                                         ("peer", "'peer' needs")])
def test_tree_decode_bad_input_raises_everywhere(pools, case, needle):
    out = pools(3).run_outcomes(_bad, case, timeout=60)
    for rank, (ok, val) in out.items():
        assert not ok and val[0] == "ValueError" and needle in val[1], (rank, val)


def _ring_vs_tree(rank, world):
    from megatron_cp_plugin.algos.ring_decode import ring_decode
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 1, 8, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 12 * world, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    ref = _reference(q, k, v, torch.ones(2, 1, 12 * world, dtype=torch.bool))
    sl = slice(12 * rank, 12 * (rank + 1))
    return max((ring_decode(q, k[:, sl], v[:, sl]) - ref).abs().max().item(),
               (mcp.tree_decode(q, k[:, sl], v[:, sl]) - ref).abs().max().item())


@pytest.mark.parametrize("world", (1, 3))
def test_ring_decode_baseline_matches_reference(pools, world):
    assert max(pools(world).run(_ring_vs_tree)) <= 1e-12


def _lengths_cases(rank, world, variant, backend):
    """A fixed-capacity cache: this rank's keys at the front of a buffer holding garbage past each row's fill
    (`kv_lengths`, ragged over the batch); a Workspace reused by two calls, as a graphed step reuses it."""
    from megatron_cp_plugin.kernels.flash_decode import Workspace
    g = torch.Generator().manual_seed(11)
    b, S, h, hk, d, cap = 2, 41, 8, 2, 64, 48
    q = torch.randn(b, 1, h, d, generator=g)
    k, v = (torch.randn(b, S, hk, d, generator=g) for _ in range(2))
    fills = torch.tensor([S, 29])                                       # row 1 has 29 tokens in all
    vis = torch.arange(S)[None, None, :] < fills[:, None, None]
    ref = _reference(q, k, v, vis)
    lo, hi = _split(S, world, rank, seed=5)
    ws = Workspace() if backend == "triton" else None
    kb, vb = (torch.randn(b, cap, hk, d, generator=g) * 100 for _ in range(2))   # garbage past the fill
    lens = (fills.clamp(lo, hi) - lo).to(torch.int32)                  # this rank's filled slots per row
    for r in range(b):
        kb[r, :lens[r]], vb[r, :lens[r]] = k[r, lo:lo + lens[r]], v[r, lo:lo + lens[r]]
    errs = []
    for _ in range(2):
        out = mcp.tree_decode(q, kb, vb, variant=variant, kv_lengths=lens, backend=backend, workspace=ws,
                              validate=False)
        errs.append(((out.double() - ref).abs().max() / ref.abs().max()).item())
    assert max(errs) <= 1e-5, (rank, variant, backend, errs)
    return True


@pytest.mark.parametrize("variant", COLLECTIVE_VARIANTS)
@pytest.mark.parametrize("world, backend", [(1, None), (3, None), (2, "triton"), (3, "triton")])
def test_tree_decode_with_kv_lengths_of_a_fixed_capacity_cache(pools, world, variant, backend):
    from megatron_cp_plugin.kernels.flash_decode import available
    if backend == "triton" and not available(torch.device("cpu")):
        pytest.skip(NO_INTERPRETER)
    assert all(pools(world).run(_lengths_cases, variant, backend))
