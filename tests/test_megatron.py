"""Megatron integration on CPU (gloo): a tiny GPT with CP = 2 and 4 gives the CP = 1 loss and gradients."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist



SEQ, VOCAB = 256, 257


def _init_mpu(world):
    from megatron.core import parallel_state as ps
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(context_parallel_size=world)
    return ps


def _batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    loss_mask = (torch.rand(2, SEQ, generator=g) > 0.1).float()      # some tokens carry no loss
    return dict(tokens=tokens, labels=torch.roll(tokens, -1, 1), loss_mask=loss_mask,
                position_ids=torch.arange(SEQ).expand(2, -1))


def _gpt_step(rank, world, algo, grid=None):
    import warnings
    warnings.filterwarnings("ignore")
    from megatron_cp_plugin.megatron import CPConfig, cp_token_mean_loss, shard_batch
    from megatron_cp_plugin.megatron.model import build_gpt, tiny_config
    ps = _init_mpu(world)
    cp_group = ps.get_context_parallel_group()
    cp = CPConfig(algo=algo, cp_size=world, grid=grid, seq_length=SEQ)
    torch.manual_seed(0)
    model = build_gpt(tiny_config(cp_size=world), cp, vocab_size=VOCAB, seq_length=SEQ, cp_group=cp_group)
    b = shard_batch(_batch(), algo=cp.algo, cp_group=cp_group)
    per_token = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
    loss, reported = cp_token_mean_loss(per_token, b["loss_mask"], cp_group)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=cp_group)                    # sum over CP ranks (DP x CP in training)
        grads[name] = g
    return reported.item(), grads


@pytest.fixture(scope="module")
def reference(pools):
    return pools(1).run(_gpt_step, "ring")[0]


@pytest.mark.parametrize("algo", ["ring", "burst", "attention2d-no", "attention2d-o"])
@pytest.mark.parametrize("world", (2, 4))
def test_loss_and_grads_equal_cp1(pools, reference, world, algo):
    ref_loss, ref_grads = reference
    for rank, (loss, grads) in enumerate(pools(world).run(_gpt_step, algo)):
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (rank, loss, ref_loss)
        for name, g in grads.items():
            err = ((g - ref_grads[name]).abs().max() / ref_grads[name].abs().max().clamp_min(1e-30)).item()
            assert err <= 1e-5, f"{algo} CP={world} rank {rank} {name}: rel err {err:.3g}"
