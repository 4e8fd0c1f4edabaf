"""Programmatic dependent launch (kernels/_launch.pdl): when it is on, and that a chain of the decode step's
kernels gives the same bits with it as without it, graphed, while each kernel's input comes from a slow kernel
just before it (a kernel that read before its griddepcontrol.wait would read the previous replay's values)."""
from __future__ import annotations

import os

import pytest
import torch

from megatron_cp_plugin.kernels import _launch

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_pdl_only_compiled_on_hopper_or_newer_and_while_switched_on(monkeypatch):
    assert _launch.pdl(torch.device("cpu")) is False
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for major, want in ((8, False), (9, True), (10, True)):
        monkeypatch.setattr(_launch, "_hopper_or_newer", lambda index, major=major: major >= 9)
        assert _launch.pdl(torch.device("cuda", 0)) is want
    monkeypatch.setattr(_launch, "PDL", False)                  # the benchmarks' --pdl off
    assert _launch.pdl(torch.device("cuda", 0)) is False
    monkeypatch.setattr(_launch, "PDL", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")                 # the CPU interpreter has no griddepcontrol
    assert _launch.pdl(torch.device("cuda", 0)) is False


def test_decode_bench_pdl_modes():
    """--pdl both adds a 'graph-nopdl' row after each graphed row; pdl_for switches PDL off inside it only."""
    from types import SimpleNamespace

    from megatron_cp_plugin.bench import decode_model as dm

    a = SimpleNamespace(context=[1024], batch=[1], decoders=["tree"], batch_max_context=1024, eager_context=[],
                        pdl="both")
    modes = [m for _, _, _, m, _ in dm.latency_configs(a, torch.device("cpu"), 1)]
    assert modes == ["graph", "graph-nopdl"] and all(dm.is_graphed(m) for m in modes)
    assert [m for _, _, _, m, _ in dm.latency_configs(SimpleNamespace(**{**vars(a), "pdl": "on"}),
                                                      torch.device("cpu"), 1)] == ["graph"]
    with dm.pdl_for("graph-nopdl"):
        assert _launch.PDL is False
    assert _launch.PDL is True
    with dm.pdl_for("graph"):
        assert _launch.PDL is True


def _chain(x, w_big, w1, b1, w2, nw, cos, sin, slot, kc, vc):
    """A slow GEMV, then PDL kernels each reading what the one before wrote: norm, GEMV (+bias, GELU), a torch
    multiply, GEMV with the residual, RoPE + append, split-KV attention and its merge."""
    from megatron_cp_plugin.kernels.flash_decode import flash_decode
    from megatron_cp_plugin.kernels.gemv import gemv
    from megatron_cp_plugin.kernels.norm import fused_norm
    from megatron_cp_plugin.kernels.rope_append import rope_append

    big = gemv(x, w_big)                                           # [1, 32768]: 256 MB of weight, ~90 us
    h = big[:, -4096:]                 # written by the slow kernel's last programs, as the next one starts
    n = fused_norm(h, nw, None, 1e-5, rms=True)                    # right after the slow kernel
    f = gemv(n, w1, b1, gelu=True) * 1.0                           # and a plain torch kernel in between
    r = gemv(f, w2, None, residual=h)                              # [1, 4096]
    q, k, v = r.view(1, 1, 32, 128), r[:, :1024].view(1, 1, 8, 128), r[:, 1024:2048].view(1, 1, 8, 128)
    qr = rope_append(q, k, v, cos, sin, slot, kc, vc)
    o, _ = flash_decode(qr, kc, vc, out_dtype=qr.dtype)
    return torch.cat([big.flatten(), n.flatten(), f.flatten(), r.flatten(), qr.flatten(), o.flatten(),
                      kc.flatten()[-2048:]])


def test_pdl_chain_graphed_gives_the_bits_without_it():
    if DEV.type != "cuda" or torch.cuda.get_device_capability()[0] < 9 or os.environ.get("TRITON_INTERPRET"):
        pytest.skip("SKIPPED LOUDLY: programmatic dependent launch needs a compiled Hopper (or newer) GPU")
    g = torch.Generator(device=DEV).manual_seed(0)
    bf = dict(device=DEV, dtype=torch.bfloat16)
    x = torch.empty(1, 4096, **bf)
    w_big = torch.randn(32768, 4096, generator=g, **bf) * 0.02
    w1, b1 = torch.randn(8192, 4096, generator=g, **bf) * 0.02, torch.randn(8192, generator=g, **bf)
    w2 = torch.randn(4096, 8192, generator=g, **bf) * 0.02
    nw = torch.rand(4096, generator=g, **bf) + 0.5
    cos, sin = torch.rand(64, device=DEV), torch.rand(64, device=DEV)
    slot = torch.tensor([511], device=DEV)
    outs = {}
    for on in (False, True):
        kc, vc = (torch.randn(1, 512, 8, 128, generator=torch.Generator(device=DEV).manual_seed(1), **bf)
                  for _ in range(2))
        _launch.PDL = on
        try:
            x.normal_(generator=torch.Generator(device=DEV).manual_seed(2))
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                _chain(x, w_big, w1, b1, w2, nw, cos, sin, slot, kc, vc)       # compile outside the capture
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = _chain(x, w_big, w1, b1, w2, nw, cos, sin, slot, kc, vc)
        finally:
            _launch.PDL = True
        gen = torch.Generator(device=DEV).manual_seed(3)
        outs[on] = []
        for _ in range(20):                                         # new inputs each replay
            x.normal_(generator=gen)
            graph.replay()
            outs[on].append(y.clone())
        torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(outs[False], outs[True])):
        assert torch.equal(a, b), f"replay {i}: PDL changed {(a != b).sum().item()} of {a.numel()} values"
    assert not torch.equal(outs[True][0], outs[True][1])            # the inputs did change between replays
