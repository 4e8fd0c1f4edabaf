"""The NVLink exchange + merge kernel (kernels/peer_merge.py) with P ranks simulated in one process: each "rank"
is a packed partial buffer and a flag array on this device, their addresses in the pointer tables the kernel
reads. On CPU through Triton's interpreter, on a GPU compiled. Programs of one launch cannot wait for each
other under the interpreter, so every flag a peer would set is set before the call; the test then checks that
the call cleared them here and set this rank's in every peer. The kernel between real GPUs, graphed and
repeated, is tests/test_gpu.py's NCCL check (tree_decode variant "peer")."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_cp_plugin.kernels import flash_decode as fd
from megatron_cp_plugin.kernels import peer_merge as pm

from .peer_sim import PROGRAMS, zero_flags
from .peer_sim import bufs as _bufs

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not fd.available(DEV), reason="SKIPPED LOUDLY: triton is not installed")


def _ranks(P, R, d, seed, empty_rows=()):
    """P simulated ranks: packed partials (some rows unseen by some ranks, `empty_rows` unseen by all) and zeroed
    flags."""
    g = torch.Generator().manual_seed(seed)
    data, flags = [], zero_flags(P, DEV)
    for p in range(P):
        o = torch.randn(R, d, generator=g)
        lse = torch.randn(R, generator=g) * 4
        unseen = torch.rand(R, generator=g) < 0.2
        unseen[list(empty_rows)] = True
        o[unseen], lse[unseen] = 0.0, float("-inf")
        data.append(torch.cat([o.flatten(), lse, torch.full((5,), 7.0)]).to(DEV))    # longer than needed
    return data, flags


@pytest.mark.parametrize("P,R,d,rank", [(1, 8, 64, 0), (2, 32, 128, 1), (3, 37, 64, 2), (8, 5, 128, 3),
                                        (2, 300, 64, 0)])
def test_merges_every_ranks_partial_and_signals_both_phases(P, R, d, rank):
    data, flags = _ranks(P, R, d, seed=P * 100 + R, empty_rows=(1,))
    n_prog = -(-R // pm.block_rows(R, PROGRAMS))
    assert n_prog <= PROGRAMS
    peers = [p for p in range(P) if p != rank]
    flags[rank][:, :n_prog, peers] = 1                       # what the peers' programs would have set
    out = torch.empty(R, d, device=DEV, dtype=torch.float32)
    lse = torch.empty(R, device=DEV)
    pm.peer_merge(_bufs(data, flags, rank), R, d, out, lse)

    parts = torch.stack([t[:R * (d + 1)] for t in data]).double()
    ref_o, ref_l = pm.peer_merge_reference(parts, d)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref_o, atol=1e-5, rtol=1e-5)
    assert torch.isinf(lse[1]) and (out[1] == 0).all(), "a row no rank saw: o = 0, lse = -inf"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_l))
    fin = torch.isfinite(ref_l)
    torch.testing.assert_close(lse.double()[fin], ref_l[fin], atol=1e-5, rtol=1e-5)
    # Both phases: this rank's flags consumed, this rank's flag set in every peer for every program that ran.
    assert int(flags[rank].sum()) == 0
    for p in peers:
        assert int(flags[p][:, :n_prog, rank].sum()) == 2 * n_prog
        assert int(flags[p].sum()) == 2 * n_prog
    # The reference against the plain definition: one merge of the P partials over the union of their keys.
    o_all = parts[:, :R * d].view(P, R, d)
    w = torch.softmax(parts[:, R * d:], 0).nan_to_num(0.0)
    torch.testing.assert_close(ref_o[fin], (o_all * w[..., None]).sum(0)[fin])


@pytest.mark.parametrize("how", ["fenced", "done=False"])
def test_fenced_buffers_make_the_ready_round_only(how):
    """Buffers fenced with another kernel's (symmetric.fence, the decode step's alternating merge and sum) make one
    flag round: the ready flags consumed here and set in every peer, the done phase untouched on every rank (a
    done signal with no waiter would be left set and let a later call pass before its peers)."""
    P, R, d, rank = 3, 37, 64, 1
    data, flags = _ranks(P, R, d, seed=5)
    n_prog = -(-R // pm.block_rows(R, PROGRAMS))
    peers = [p for p in range(P) if p != rank]
    flags[rank][0, :n_prog, peers] = 1                      # the peers' ready signals only
    b = _bufs(data, flags, rank)
    b.fenced = how == "fenced"
    out, lse = torch.empty(R, d, device=DEV), torch.empty(R, device=DEV)
    pm.peer_merge(b, R, d, out, lse, **({"done": False} if how == "done=False" else {}))
    ref_o, _ = pm.peer_merge_reference(torch.stack([t[:R * (d + 1)] for t in data]).double(), d)
    torch.testing.assert_close(out.double(), ref_o, atol=1e-5, rtol=1e-5)
    assert int(flags[rank].sum()) == 0
    for p in peers:
        assert int(flags[p][0, :n_prog, rank].sum()) == n_prog and int(flags[p].sum()) == n_prog


def test_fence_takes_two_buffers_of_one_rank():
    from megatron_cp_plugin.symmetric import fence
    data, flags = _ranks(2, 4, 64, seed=1)
    a, b = _bufs(data, flags, 0), _bufs(data, flags, 0)
    for x, y in ((a, a), (a, _bufs(data, flags, 1))):
        with pytest.raises(ValueError, match="two different PeerBuffers"):
            fence(x, y)
    assert not a.fenced and not b.fenced
    fence(a, b)
    assert a.fenced and b.fenced


def test_agrees_with_the_allgather_merge_kernel():
    """The same partials through merge_packed (the all-gather variant's merge) give the same rows."""
    data, flags = _ranks(2, 32, 128, seed=3)
    flags[0][:, :8, 1] = 1
    out = torch.empty(32, 128, device=DEV)
    lse = torch.empty(32, device=DEV)
    pm.peer_merge(_bufs(data, flags, 0), 32, 128, out, lse)
    o2, l2 = fd.merge_packed(torch.stack([t[:32 * 129] for t in data]), 128)
    torch.testing.assert_close(out, o2, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, l2, atol=1e-6, rtol=1e-6)


def test_rejects_a_buffer_too_small_and_a_wrong_output():
    data, flags = _ranks(2, 8, 64, seed=1)
    bufs = _bufs(data, flags, 0)
    with pytest.raises(ValueError, match="peer_merge"):
        pm.peer_merge(bufs, 9, 64, torch.empty(9, 64, device=DEV), torch.empty(9, device=DEV))
    with pytest.raises(ValueError, match="out_lse"):
        pm.peer_merge(bufs, 8, 64, torch.empty(8, 64, device=DEV), torch.empty(8, device=DEV, dtype=torch.float64))


def test_the_benchmark_says_why_it_cannot_run_here(tmp_path):
    """`megatron-cp-bench peer-merge` (bench/peer_merge.py) outside one NVLink node: one line, exit 0."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "megatron_cp_plugin.bench", "peer-merge", "--out", str(tmp_path / "p")],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "the peer kernel cannot run here" in r.stdout and "nothing run" in r.stdout


def test_the_workspace_keeps_an_object_while_it_fits():
    """Workspace.keep (where tree_decode keeps its symmetric buffers): made once, reused while `fits`, made again
    (a new rendezvous) when the rows grow."""
    ws = fd.Workspace()
    made = []

    def make(n):
        made.append(n)
        return SimpleNamespace(n=n)

    a = ws.keep("x", torch.device("cpu"), lambda: make(8), fits=lambda o: o.n >= 8)
    assert ws.keep("x", torch.device("cpu"), lambda: make(8), fits=lambda o: o.n >= 4) is a
    b = ws.keep("x", torch.device("cpu"), lambda: make(16), fits=lambda o: o.n >= 16)
    assert b is not a and b.n == 16 and made == [8, 16]
