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


# ------------------------------------------------------------------------------------------- packed (THD) batches
EOD = VOCAB - 1
DOC_ENDS = (60, 67, 68, 130, 131, 200)      # EOD positions: documents of 61, 7, 1, 62, 1, 69 and 56 tokens


def _eod_batch():
    """One row of SEQ tokens whose EOD tokens end documents (the last document ends with the row)."""
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, EOD, (1, SEQ), generator=g)
    tokens[0, list(DOC_ENDS)] = EOD
    loss_mask = (torch.rand(1, SEQ, generator=g) > 0.1).float()
    return dict(tokens=tokens, labels=torch.roll(tokens, -1, 1), loss_mask=loss_mask,
                position_ids=torch.arange(SEQ)[None])


def _packed_gpt_step(rank, world, algo, per_document=False):
    """Loss and CP-summed gradients of the tiny GPT on the packed batch (documents padded to 8 = 2 x 4 tokens,
    the unit of CP = 4, so every CP size sees the same packing); per_document: every document run on its own,
    unpacked, at CP = 1 (the reference: what packing must reproduce)."""
    import warnings
    warnings.filterwarnings("ignore")
    from megatron_cp_plugin.megatron import CPConfig, cp_token_mean_loss, pack_documents, shard_batch
    from megatron_cp_plugin.megatron.model import build_gpt, tiny_config
    ps = _init_mpu(world)
    cp_group = ps.get_context_parallel_group()
    cp = CPConfig(algo=algo, cp_size=world, seq_length=SEQ)
    torch.manual_seed(0)
    model = build_gpt(tiny_config(cp_size=world), cp, vocab_size=VOCAB, seq_length=SEQ, cp_group=cp_group)
    packed = pack_documents(_eod_batch(), eod=EOD, unit=8)
    assert packed["tokens"].shape == (1, SEQ) and packed["dropped"] > 0
    if per_document:
        offs = packed["cu_seqlens"].tolist()
        per_token = torch.cat([model(packed["tokens"][:, a:b], torch.arange(b - a)[None], None,
                                     labels=packed["labels"][:, a:b]) for a, b in zip(offs, offs[1:])], 1)
        b = packed
    else:
        b = shard_batch(packed, algo=cp.algo, cp_group=cp_group)
        per_token = model(b["tokens"], b["position_ids"], None, labels=b["labels"],
                          packed_seq_params=b["packed_seq_params"])
    loss, reported = cp_token_mean_loss(per_token, b["loss_mask"], cp_group)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=cp_group)
        grads[name] = g
    return reported.item(), grads


@pytest.fixture(scope="module")
def packed_reference(pools):
    return pools(1).run(_packed_gpt_step, "ring", True)[0]


@pytest.mark.parametrize("algo", ["ring", "burst", "attention2d-no", "attention2d-o"])
@pytest.mark.parametrize("world", (1, 2, 4))
def test_packed_loss_and_grads_equal_documents_run_alone(pools, packed_reference, world, algo):
    """Issue 18: packed documents (EOD-split, padded, positions reset) at CP = 1, 2, 4 give the loss and
    gradients of every document run on its own: no attention across documents, RoPE positions restart."""
    if world == 1 and algo != "ring":
        pytest.skip("at CP = 1 every algorithm is the same local kernel")
    ref_loss, ref_grads = packed_reference
    for rank, (loss, grads) in enumerate(pools(world).run(_packed_gpt_step, algo)):
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (rank, loss, ref_loss)
        for name, g in grads.items():
            err = ((g - ref_grads[name]).abs().max() / ref_grads[name].abs().max().clamp_min(1e-30)).item()
            assert err <= 1e-5, f"packed {algo} CP={world} rank {rank} {name}: rel err {err:.3g}"


def test_pack_documents_splits_at_eod_pads_and_resets_positions():
    from megatron_cp_plugin.megatron.batch import pack_documents

    e = 9
    tokens = torch.tensor([[1, 2, e, 3, e, 4, 5, 6], [e, 7, 7, 7, 7, 7, 7, 7]])
    batch = dict(tokens=tokens, labels=tokens + 100, loss_mask=torch.ones(2, 8))
    grown = pack_documents(batch, eod=e, unit=4, keep_length=False)
    assert grown["cu_seqlens"].tolist() == [0, 4, 8, 12, 16, 24] and grown["dropped"] == 0
    assert grown["tokens"][0, :8].tolist() == [1, 2, e, e, 3, e, e, e]            # pads: eod, no loss
    assert grown["loss_mask"][0, :8].tolist() == [1, 1, 1, 0, 1, 1, 0, 0]
    assert grown["position_ids"][0, 8:16].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    kept = pack_documents(batch, eod=e, unit=4)                                    # rows stay 8 tokens
    assert kept["tokens"].shape == (1, 16) and kept["cu_seqlens"].tolist() == [0, 4, 8, 12, 16]
    assert kept["tokens"][0, 12:].tolist() == [7, 7, 7, 7] and kept["dropped"] == 3 + 3
    assert kept["labels"][0, :3].tolist() == [101, 102, 109] and kept["max_seqlen"] == 4


def test_packed_rope_tables():
    """THD: zigzag gets the plain table (Megatron slices it per document, as TE's layout); cyclic gets a
    whole-sequence table Megatron's per-document zigzag slicer reads as cyclic in-document positions; TE's
    fused THD RoPE cannot do that, so it is refused for cyclic layouts."""
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_cp_plugin.megatron.batch import packed_seq_params
    from megatron_cp_plugin.megatron.rope import CPRotaryEmbedding

    class Group:
        def size(self):
            return 2

        def rank(self):
            return 1

    inner = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    full = CPRotaryEmbedding(inner, algo="ring", cp_group=Group())._full_table(8, 0)
    zig = CPRotaryEmbedding(inner, algo="ring", cp_group=Group())
    assert torch.equal(zig(8, packed_seq=True), full)
    cyc = CPRotaryEmbedding(inner, algo="attention2d-no", cp_group=Group())
    cyc.packed_seq_params = packed_seq_params(cu)
    table = cyc(8, packed_seq=True)
    assert table.shape[0] == 12
    # What Megatron's THD path reads for rank 1's local rows (4 of document 0, 2 of document 1): in-document
    # positions 1, 3, 5, 7 and 1, 3 (cyclic), not zigzag's 2, 3, 4, 5 and 1, 2.
    read = torch.cat([_get_thd_freqs_on_this_cp_rank(1, 2, torch.empty(n), table, int(o))
                      for n, o in ((4, 0), (2, 8))])
    assert torch.equal(read, full[[1, 3, 5, 7, 1, 3]])
    fused = CPRotaryEmbedding(inner, algo="attention2d-o", cp_group=Group(), rope_fusion=True)
    fused.packed_seq_params = cyc.packed_seq_params
    with pytest.raises(ValueError, match="--no-rope-fusion"):
        fused(8, packed_seq=True)


def test_megatron_fsdp_keeps_fp32_main_gradients_on_every_megatron_core():
    """Newer megatron-core (0.19.2) ignores grad_reduce_in_fp32 under Megatron-FSDP and keeps bf16 gradients plus an
    fp32 copy for the optimizer (issue 35: GPT-3 13B ran out of memory in Adam's step); the trainer asks for fp32
    main gradients where the config has the field, and adds nothing where grad_reduce_in_fp32 decides (0.16.1)."""
    import dataclasses

    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_cp_plugin.megatron.compat import fsdp_grad_dtype_kwargs

    @dataclasses.dataclass
    class Newer:
        grad_reduce_in_fp32: bool = False
        megatron_fsdp_main_grads_dtype: object = None

    @dataclasses.dataclass
    class Older:
        grad_reduce_in_fp32: bool = False

    assert fsdp_grad_dtype_kwargs(Newer, True) == {"megatron_fsdp_main_grads_dtype": torch.float32}
    assert fsdp_grad_dtype_kwargs(Newer, False) == {} == fsdp_grad_dtype_kwargs(Older, True)
    kw = fsdp_grad_dtype_kwargs(DistributedDataParallelConfig, True)   # the installed megatron-core takes it
    cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, **kw)
    assert getattr(cfg, "megatron_fsdp_main_grads_dtype", torch.float32) == torch.float32
