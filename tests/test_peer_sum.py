"""The split MLPs' NVLink reduce kernel (kernels/peer_sum.py) with P ranks simulated in one process, as
tests/test_peer_merge.py does: each "rank" an fp32 partial buffer and a flag array on this device, their addresses in
the pointer tables the kernel reads; on CPU through Triton's interpreter, on a GPU compiled. Every flag a peer
would set is set before the call; the test then checks that the call cleared them here and set this rank's in every
peer. The kernel between real GPUs runs in the static decode step (the bench's graph == eager and CP = 2 == CP = 1
token checks, scripts/gpu_decode_check.sh)."""
from __future__ import annotations

import pytest
import torch

from megatron_cp_plugin.kernels import flash_decode as fd
from megatron_cp_plugin.kernels import peer_sum as ps

from .peer_sim import PROGRAMS, zero_flags
from .peer_sim import bufs as _bufs

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not fd.available(DEV), reason="SKIPPED LOUDLY: triton is not installed")


def _ranks(P, numel, seed):
    g = torch.Generator().manual_seed(seed)
    data = [torch.cat([torch.randn(numel, generator=g), torch.full((7,), 1e6)]).to(DEV) for _ in range(P)]
    flags = zero_flags(P, DEV)
    return data, flags


@pytest.mark.parametrize("P, rows, n, rank", [(1, 1, 4096, 0), (2, 1, 4096, 1), (3, 8, 4100, 2), (8, 2, 300, 5),
                                              (2, 16, 4096, 0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias, res", [(True, True), (False, False), (True, False)])
def test_sums_every_ranks_partial_adds_bias_and_residual_and_signals_both_phases(P, rows, n, rank, dtype, bias, res):
    numel = rows * n
    data, flags = _ranks(P, numel, seed=P * 1000 + numel)
    g = torch.Generator().manual_seed(numel)
    b = torch.randn(n, generator=g).to(DEV, dtype) if bias else None
    r = (4 * torch.randn(rows, n, generator=g)).to(DEV, dtype) if res else None
    n_prog = -(-numel // ps.block_elems(numel, PROGRAMS))
    assert n_prog <= PROGRAMS
    peers = [p for p in range(P) if p != rank]
    flags[rank][:, :n_prog, peers] = 1                       # what the peers' programs would have set
    out = torch.full((rows, n), float("nan"), device=DEV, dtype=dtype)
    assert ps.peer_sum(_bufs(data, flags, rank), rows, n, out, bias=b, residual=r) is out

    parts = torch.stack([t[:numel] for t in data])
    ref = ps.peer_sum_reference(parts, rows, n, b, r, dtype)       # fp32 sums in rank order, then one rounding
    exact = ps.peer_sum_reference(parts.double(), rows, n, None if b is None else b.double(),
                                  None if r is None else r.double())
    assert torch.isfinite(out).all()
    assert torch.equal(out, ref) if dtype == torch.float32 else \
        ((out.double() - ref.double()).abs() <= 2 * torch.finfo(dtype).eps * ref.double().abs()).all()
    torch.testing.assert_close(out.double(), exact, atol=2e-5 if dtype == torch.float32 else 0.06, rtol=1e-2)
    # Both phases: this rank's flags consumed, this rank's flag set in every peer for every program that ran.
    assert int(flags[rank].sum()) == 0
    for p in peers:
        assert int(flags[p][:, :n_prog, rank].sum()) == 2 * n_prog and int(flags[p].sum()) == 2 * n_prog


def test_without_the_done_round_only_the_ready_flags_move():
    """done=False (fenced buffers, symmetric.fence): the ready flags consumed here and set in every peer, the done
    phase untouched."""
    P, rows, n, rank = 3, 2, 1000, 2
    data, flags = _ranks(P, rows * n, seed=4)
    n_prog = -(-rows * n // ps.block_elems(rows * n, PROGRAMS))
    peers = [p for p in range(P) if p != rank]
    flags[rank][0, :n_prog, peers] = 1
    out = ps.peer_sum(_bufs(data, flags, rank), rows, n, torch.empty(rows, n, device=DEV), done=False)
    assert torch.equal(out, ps.peer_sum_reference(torch.stack([t[:rows * n] for t in data]), rows, n))
    assert int(flags[rank].sum()) == 0
    for p in peers:
        assert int(flags[p][0, :n_prog, rank].sum()) == n_prog and int(flags[p].sum()) == n_prog


def test_the_sum_is_the_same_bits_on_every_rank():
    """Every rank sums in rank order: the P outputs are equal bit for bit (the decode step's ranks must sample the
    same token)."""
    P, rows, n = 3, 2, 1000
    data, flags = _ranks(P, rows * n, seed=9)
    outs = []
    for rank in range(P):
        flags[rank][:, :, [p for p in range(P) if p != rank]] = 1
        outs.append(ps.peer_sum(_bufs(data, flags, rank), rows, n, torch.empty(rows, n, device=DEV)))
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_rejects_a_buffer_too_small_and_wrong_operands():
    data, flags = _ranks(2, 64, seed=1)
    flags[0][:, :, 1] = 1                  # a call wrongly let through finishes (DID NOT RAISE) instead of spinning
    bufs = _bufs(data, flags, 0)
    out = torch.empty(8, 8, device=DEV)
    with pytest.raises(ValueError, match="a buffer of >= 72"):
        ps.peer_sum(bufs, 9, 8, torch.empty(9, 8, device=DEV))
    with pytest.raises(ValueError, match=r"bias \[8\]"):
        ps.peer_sum(bufs, 8, 8, out, bias=torch.zeros(8, device=DEV, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"residual \[8, 8\]"):
        ps.peer_sum(bufs, 8, 8, out, residual=torch.zeros(8, 9, device=DEV))
    with pytest.raises(ValueError, match="out"):
        ps.peer_sum(bufs, 8, 8, torch.empty(8, 16, device=DEV)[:, :8])


def test_the_benchmark_says_why_it_cannot_run_here(tmp_path):
    """`megatron-cp-bench peer-sum` (bench/peer_sum.py) outside one NVLink node: one line, exit 0."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "megatron_cp_plugin.bench", "peer-sum", "--out", str(tmp_path / "p")],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "the peer kernel cannot run here" in r.stdout and "nothing run" in r.stdout
