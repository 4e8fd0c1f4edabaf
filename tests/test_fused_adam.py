"""megatron/compat.use_fused_adam: megatron-core's torch Adam (no TE or Apex) switched to torch's fused kernel
steps as its foreach form does, only where it may (plain floating tensors on the named devices), and keeps the
fused kernel's state layout after a checkpoint load restored CPU steps. On CPU torch's fused kernel runs too, so
the switch is tested here with devices=("cpu",); the GPU case (the trainer's) where a GPU is."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_cp_plugin.megatron.compat import use_fused_adam

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _wrapped(params, **kw):
    """Megatron's shape: a ChainedOptimizer of wrappers, each with the torch optimizer as `.optimizer`."""
    inner = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kw)
    return SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=inner)]), inner


def _params(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(device).requires_grad_() for n in (7, 33, 128)]


@pytest.mark.parametrize("device", DEVICES)
def test_fused_steps_as_foreach(device):
    ref, fused = _params(device), _params(device)
    opt_ref, _ = _wrapped(ref, foreach=True)
    opt, inner = _wrapped(fused, foreach=True)
    assert use_fused_adam(opt, devices=(device,))
    assert all(g["fused"] and not g["foreach"] for g in inner.param_groups)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=g).to(device) for p in ref]
        for ps in (ref, fused):
            for p, gr in zip(ps, grads):
                p.grad = gr.clone()
        opt_ref.chained_optimizers[0].optimizer.step()
        inner.step()
    for a, b in zip(ref, fused):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    assert all(inner.state[p]["step"].dtype == torch.float32 and inner.state[p]["step"].device == p.device
               and float(inner.state[p]["step"]) == 5.0 for p in fused)


def test_a_restored_cpu_step_moves_to_the_parameters_device_and_a_second_call_changes_nothing():
    device = DEVICES[-1]
    ps = _params(device)
    opt, inner = _wrapped(ps)
    for p in ps:                                       # what restore_adam_steps leaves: a CPU float64 step
        inner.state[p].update(step=torch.tensor(3.0, dtype=torch.float64), exp_avg=torch.zeros_like(p),
                              exp_avg_sq=torch.zeros_like(p))
    assert use_fused_adam(opt, devices=(device,)) and use_fused_adam(opt, devices=(device,))
    for p in ps:
        st = inner.state[p]["step"]
        assert (st.device, st.dtype, float(st)) == (p.device, torch.float32, 3.0)
        p.grad = torch.ones_like(p)
    inner.step()                                       # the fused kernel accepts the state
    assert all(float(inner.state[p]["step"]) == 4.0 for p in ps)


def test_only_plain_floating_tensors_on_the_named_devices_are_switched():
    opt, inner = _wrapped(_params("cpu"), foreach=True)
    assert not use_fused_adam(opt, devices=("cuda",))                  # the trainer's call on CPU tensors
    assert inner.param_groups[0]["foreach"] and not inner.param_groups[0]["fused"]
    other = SimpleNamespace(optimizer=torch.optim.SGD(_params("cpu"), lr=0.1))   # not Adam: left alone
    assert not use_fused_adam(SimpleNamespace(chained_optimizers=[other]), devices=("cpu",))
    assert "fused" not in other.optimizer.param_groups[0] or not other.optimizer.param_groups[0]["fused"]
