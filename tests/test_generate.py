"""Generation with a sharded KV cache: CP = 2 and 4 (each prefill algo) give exactly the CP = 1 tokens."""
from __future__ import annotations

import pytest
import torch


L, NEW, VOCAB = 16, 32, 257


def _varied(tokens):
    """A token-equality check proves something only if the tokens it compares vary (inference/token_check.py:
    at least MIN_DISTINCT of 32 distinct in every row)."""
    from megatron_cp_plugin.inference.token_check import variety

    why = variety(tokens)
    assert why is None, why
    return tokens


def _tiny_model(world, algo, gated=False):
    """(model, cp_group, cp config, prompt [2, L]) of the tiny GPT every generation test decodes with (gated: its
    MLPs a SwiGLU, fc1 [gate; up] with a bias)."""
    import warnings
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps

    from megatron_cp_plugin.inference.token_check import vary_greedy_tokens_
    from megatron_cp_plugin.megatron import CPConfig
    from megatron_cp_plugin.megatron.model import build_gpt, tiny_config
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(context_parallel_size=world)
    cp_group = ps.get_context_parallel_group()
    torch.manual_seed(0)
    cp = CPConfig(algo=algo, cp_size=world)
    # fp64: greedy decoding compares argmaxes, and in fp32 a near-tie flipped one token of 64 on CI's CPU
    # (ring decode at P = 3 merges in another order than CP = 1); fp64 leaves no such near-ties. Q, K scaled
    # (the token-check model): Megatron's init attends almost uniformly here, and its greedy tokens repeat.
    cfg = tiny_config(cp_size=world, dtype=torch.float64)
    if gated:
        cfg.gated_linear_unit, cfg.activation_func = True, torch.nn.functional.silu
    model = vary_greedy_tokens_(build_gpt(cfg, cp, vocab_size=VOCAB, seq_length=L + NEW, cp_group=cp_group))
    if gated:                      # Megatron's biases start at zero (fc2's stays: a fixed output vector fixes tokens)
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for mlp in (layer.mlp for layer in model.decoder.layers):
                mlp.linear_fc1.bias.copy_(0.3 * torch.randn(mlp.linear_fc1.bias.shape, generator=g,
                                                            dtype=torch.float64))
    prompt = torch.randint(0, VOCAB, (2, L), generator=torch.Generator().manual_seed(3))
    return model, cp_group, cp, prompt


def _generate(rank, world, algo, temperature=0.0, prompt_len=L, decoder="tree"):
    from megatron_cp_plugin.inference import DecodeState, generate, install_decode_state
    model, cp_group, cp, prompt = _tiny_model(world, algo)
    prompt = prompt[:, :prompt_len]
    state = DecodeState(cp_group, decoder=decoder)
    install_decode_state(model, state)
    out = generate(model, prompt, max_new_tokens=NEW, state=state, algo=cp.algo, temperature=temperature,
                   top_p=0.9, seed=5)
    shard_len = state.cache[1].n if state.cache else 0
    from megatron_cp_plugin.inference.hooks import core_owners
    from megatron_cp_plugin.megatron import CPCoreAttention, CPRotaryEmbedding
    assert all(type(m.core_attention) is CPCoreAttention for m in core_owners(model))   # generation's stand-ins
    assert type(model.rotary_pos_emb) is CPRotaryEmbedding                              # are gone again
    return out.tolist(), shard_len


@pytest.fixture(scope="module")
def reference(pools):
    return _varied(pools(1).run(_generate, "ring")[0][0])


@pytest.mark.parametrize("algo", ["ring", "burst", "attention2d-no", "attention2d-o"])
@pytest.mark.parametrize("world", (2, 4))
def test_greedy_tokens_equal_cp1(pools, reference, world, algo):
    res = pools(world).run(_generate, algo)
    for tokens, shard_len in res:
        assert tokens == reference
    # Each rank holds only its shard: L / P prompt tokens plus its round-robin share of the new ones.
    lens = sorted(s for _, s in res)
    assert sum(lens) == L + NEW - 1 and lens[-1] - lens[0] <= 1


def test_top_p_sampling_is_the_same_on_every_rank_and_as_cp1(pools):
    ref = pools(1).run(_generate, "ring", 0.8)[0][0]
    res = pools(2).run(_generate, "burst", 0.8)
    assert all(t == ref for t, _ in res)


@pytest.mark.parametrize("prompt_len", (13, 3))
def test_prompt_not_divisible_prefills_a_prefix_and_decodes_the_rest(pools, prompt_len):
    ref = _varied(pools(1).run(_generate, "ring", 0.0, prompt_len)[0][0])
    res = pools(4).run(_generate, "ring", 0.0, prompt_len)   # 2P = 8: 8 + 5 decode steps; 3: all decoded
    assert all(t == ref for t, _ in res)


@pytest.mark.parametrize("world", (2, 3))
def test_ring_decode_baseline_gives_the_same_tokens(pools, reference, world):
    L_ok = L - L % (2 * world)
    ref = reference if L_ok == L else _varied(pools(1).run(_generate, "ring", 0.0, L_ok)[0][0])
    res = pools(world).run(_generate, "ring", 0.0, L_ok, "ring")
    assert all(t == ref for t, _ in res)


# ------------------------------------------------------------------------------ the static (graphable) decode step
def _static(rank, world, algo, temperature=0.0, prompt_len=L, decoder="tree", variant=None, capacity_slack=0,
            mlp=None, gated=False):
    from megatron_cp_plugin.inference.static import StaticDecoder
    model, cp_group, cp, prompt = _tiny_model(world, algo, gated)
    prompt = prompt[:, :prompt_len]
    dec = StaticDecoder(model, cp_group, batch=2, capacity=-(-(prompt_len + NEW) // world) + capacity_slack,
                        decoder=decoder, variant=variant, graphed=False, temperature=temperature, top_p=0.9, seed=5,
                        mlp=mlp)
    # Unless told, P > 1 splits every MLP: this rank's fc1 rows and fc2 columns, ffn / P of them (a gated fc1 both
    # halves' share), views of the model's weights except a gated fc1.
    assert dec.mlp == (mlp or ("split" if world > 1 else "whole"))
    assert dec.peer_rounds == 2                     # gloo: no NVLink peer kernels, so nothing to fence
    ffn = model.decoder.layers[0].mlp.linear_fc2.weight.shape[1]
    for w1, w2 in zip(dec.split.fc1_weight, dec.split.fc2_weight) if dec.split else ():
        assert w2.shape[1] in (ffn // world, -(-ffn // world)) and w1.shape[0] == (2 if gated else 1) * w2.shape[1]
    out = dec.generate(prompt, max_new_tokens=NEW, algo=algo)
    # The cache holds this rank's round-robin share only, at the fill the step advanced on the device.
    assert int(dec.cache.fill) == dec.fill_host and dec.position_host == prompt_len + NEW - 1
    assert (dec.cache.pos[:, :dec.fill_host] >= 0).all() and (dec.cache.pos[:, dec.fill_host:] == -1).all()
    return out.tolist(), dec.fill_host


@pytest.mark.parametrize("world, algo, decoder, variant", [
    (1, "ring", "tree", None), (2, "ring", "tree", None), (2, "attention2d-o", "tree", "allreduce3"),
    (4, "burst", "tree", "allreduce2"), (2, "ring", "ring", None)])
def test_static_step_eager_gives_the_existing_paths_tokens(pools, reference, world, algo, decoder, variant):
    # The static step (fixed-capacity cache, device positions and lengths, device sampling) run eagerly: the
    # same greedy tokens as generate() at CP = 1, on every rank, for every merge variant and ring decoding.
    res = pools(world).run(_static, algo, 0.0, L, decoder, variant, 3)
    assert all(tokens == reference for tokens, _ in res)
    fills = sorted(f for _, f in res)
    assert sum(fills) == L + NEW - 1 and fills[-1] - fills[0] <= 1


@pytest.mark.parametrize("world", (2, 3))
def test_static_step_split_mlp_gives_the_whole_mlps_tokens(pools, world):
    """Each MLP split over the CP ranks (fc1 rows, fc2 columns, the fp32 partials summed on every rank, bias and
    residual added once; 3 ranks: an uneven split of ffn 128): the CP = 1 tokens, for a plain-GELU MLP and a
    SwiGLU one whose fc1 is [gate; up] with a bias (a rank whose gate and up features did not match changes them;
    tests/test_split_mlp.py holds each MLP's output to the whole one's)."""
    ref = _varied(pools(1).run(_static, "ring", 0.0, L, "tree", None, 3, None, True)[0][0])
    res = pools(world).run(_static, "ring", 0.0, L, "tree", None, 3, "split", True)
    assert all(tokens == ref for tokens, _ in res)
    whole = pools(world).run(_static, "ring", 0.0, L, "tree", None, 3, "whole", False)
    split = pools(world).run(_static, "ring", 0.0, L, "tree", None, 3, "split", False)
    assert whole == split and all(tokens == pools(1).run(_static, "ring")[0][0] for tokens, _ in split)


@pytest.mark.parametrize("prompt_len", (13, 3))
def test_static_step_prompt_tail_and_no_prefill(pools, prompt_len):
    ref = _varied(pools(1).run(_generate, "ring", 0.0, prompt_len)[0][0])
    assert all(t == ref for t, _ in pools(4).run(_static, "ring", 0.0, prompt_len))


def test_static_sdpa_anchor_gives_the_same_greedy_tokens_at_cp1(pools, reference):
    # The single-GPU anchor (torch's SDPA over the whole cache, unfilled slots masked) is the same attention.
    assert pools(1).run(_static, "ring", 0.0, L, "sdpa", None, 3)[0][0] == reference


def test_static_top_p_is_the_same_on_every_rank_and_cp_size(pools):
    ref = pools(1).run(_static, "ring", 0.8)[0][0]
    res = pools(2).run(_static, "burst", 0.8)
    assert all(t == ref for t, _ in res)
    greedy = pools(1).run(_static, "ring", 0.0)[0][0]
    assert ref != greedy                                     # it did sample


def _static_bad(rank, world, case):
    from megatron.core import parallel_state as ps

    from megatron_cp_plugin.inference.static import StaticDecoder
    from megatron_cp_plugin.megatron import CPConfig
    from megatron_cp_plugin.megatron.model import build_gpt, tiny_config
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(context_parallel_size=world)
    g = ps.get_context_parallel_group()
    model = build_gpt(tiny_config(cp_size=world), CPConfig(algo="ring", cp_size=world), vocab_size=VOCAB,
                      seq_length=64, cp_group=g)
    kw = {"batch": 1, "capacity": 4, "graphed": False, **case}
    dec = StaticDecoder(model, g, **kw)
    dec.generate(torch.zeros(1, 8, dtype=torch.long), max_new_tokens=4, algo="ring")


@pytest.mark.parametrize("case, needle", [({"decoder": "nope"}, "decoder"), ({"variant": "x"}, "variant"),
                                          ({"decoder": "sdpa"}, "P = 1 only"),
                                          ({"top_p": 0.0}, "top_p"), ({"capacity": 0}, "capacity"),
                                          ({"mlp": "half"}, "mlp must be"),
                                          ({"peer_rounds": 3}, "peer_rounds must be"),
                                          ({"peer_rounds": 1}, "peer_rounds=1 needs the 'peer' tree merge"),
                                          ({}, "capacity")])    # 8 + 4 tokens need 6 slots per rank, not 4
def test_static_bad_input(pools, case, needle):
    out = pools(2).run_outcomes(_static_bad, case, timeout=60)
    for ok, val in out.values():
        assert not ok and val[0] == "ValueError" and needle in val[1], val


# ------------------------------------------------------------------------------ device sampling
def test_top_p_sampling_draws_the_nucleus_distribution():
    from megatron_cp_plugin.inference.sampling import sample, uniform
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -1.0, -3.0])
    temperature, top_p, n = 0.9, 0.8, 40000
    # fp64 reference: softmax(logits / T), the smallest prefix (by probability) reaching top_p, renormalised.
    p = torch.softmax(logits.double() / temperature, -1)
    order = p.argsort(descending=True)
    keep = (p[order].cumsum(0) - p[order]) < top_p
    ref = torch.zeros_like(p)
    ref[order[keep]] = p[order[keep]]
    ref /= ref.sum()
    # n rows of the same logits: n independent draws (each row has its own random numbers).
    tok = sample(logits.expand(n, -1), temperature=temperature, top_p=top_p, seed=3, key=torch.tensor([17]))
    freq = torch.bincount(tok, minlength=6).double() / n
    sigma = (ref * (1 - ref) / n).sqrt()
    assert ((freq - ref).abs() <= 5 * sigma + 1e-12).all(), (freq, ref)
    assert (freq[ref == 0] == 0).all() and ref[3:].sum() == 0           # outside the nucleus: never drawn
    # Counter-based: the same (seed, key) gives the same draws, another key others; uniforms in (0, 1).
    again = sample(logits.expand(n, -1), temperature=temperature, top_p=top_p, seed=3, key=torch.tensor([17]))
    other = sample(logits.expand(n, -1), temperature=temperature, top_p=top_p, seed=3, key=torch.tensor([18]))
    assert torch.equal(tok, again) and not torch.equal(tok, other)
    u = uniform(0, torch.tensor([5]), (4, 50000))
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01 and len(u.unique()) > 190000
    assert torch.equal(sample(logits[None], temperature=0.0, top_p=1.0, seed=0, key=torch.tensor([0])),
                       torch.tensor([0]))


def test_cache_padding_is_zero_so_masked_slots_cannot_poison_the_output(monkeypatch):
    """The ring-decode baseline attends over whole padded shards: a masked slot still enters P V as 0 x V, and
    0 x NaN = NaN. Uninitialised memory holding a NaN pattern flipped greedy tokens on CI (P = 3); here every
    new_empty allocation is poisoned with NaN, so the cache must not take its padding from one."""
    from megatron_cp_plugin.inference.generate import KVShard
    from megatron_cp_plugin.kernels.local_attn import decode_fwd
    real = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **kw: real(self, *a, **kw).fill_(float("nan")))
    g = torch.Generator().manual_seed(0)
    k, v, q = (torch.randn(2, n, 2, 8, generator=g, dtype=torch.float64) for n in (3, 3, 1))
    shard = KVShard(k, v, torch.arange(3).expand(2, 3), capacity=4)
    shard.push(k[:, :1], v[:, :1], 3)
    ck, cv, cpos = shard.view(7)                   # grown past the capacity: 3 padding slots
    assert (cpos[:, 4:] == -1).all() and torch.isfinite(ck).all() and torch.isfinite(cv).all()
    o, lse = decode_fwd(q, ck, cv, kv_positions=cpos)
    o_ref, lse_ref = decode_fwd(q, ck[:, :4], cv[:, :4])
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(lse, lse_ref)


def test_sdpa_anchor_is_attention_over_each_rows_filled_slots():
    from megatron_cp_plugin.kernels.local_attn import sdpa_over_cache

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 8, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 20, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    lengths = torch.tensor([13, 20])
    got = sdpa_over_cache(q, k, v, lengths, scale=0.3)
    for i, n in enumerate(lengths.tolist()):
        for head in range(8):
            kv = head // 4                                            # GQA: 4 query heads a KV head
            p = torch.softmax(0.3 * k[i, :n, kv] @ q[i, 0, head], 0)
            torch.testing.assert_close(got[i, 0, head], p @ v[i, :n, kv], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="one new token per sequence"):
        sdpa_over_cache(q.expand(2, 2, 8, 16), k, v, lengths)
