"""Generation with a sharded KV cache: CP = 2 and 4 (each prefill algo) give exactly the CP = 1 tokens."""
from __future__ import annotations

import pytest
import torch


L, NEW, VOCAB = 16, 32, 257


def _generate(rank, world, algo, temperature=0.0, prompt_len=L, decoder="tree"):
    import warnings
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps

    from megatron_cp_plugin.inference import DecodeState, generate, install_decode_state
    from megatron_cp_plugin.megatron import CPConfig
    from megatron_cp_plugin.megatron.model import build_gpt, tiny_config
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(context_parallel_size=world)
    cp_group = ps.get_context_parallel_group()
    torch.manual_seed(0)
    cp = CPConfig(algo=algo, cp_size=world)
    model = build_gpt(tiny_config(cp_size=world), cp, vocab_size=VOCAB, seq_length=L + NEW, cp_group=cp_group)
    state = DecodeState(cp_group, decoder=decoder)
    install_decode_state(model, state)
    prompt = torch.randint(0, VOCAB, (2, L), generator=torch.Generator().manual_seed(3))[:, :prompt_len]
    out = generate(model, prompt, max_new_tokens=NEW, state=state, algo=cp.algo, temperature=temperature,
                   top_p=0.9, seed=5)
    shard_len = state.cache[1].n if state.cache else 0
    return out.tolist(), shard_len


@pytest.fixture(scope="module")
def reference(pools):
    return pools(1).run(_generate, "ring")[0][0]


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
    ref = pools(1).run(_generate, "ring", 0.0, prompt_len)[0][0]
    res = pools(4).run(_generate, "ring", 0.0, prompt_len)   # 2P = 8: 8 + 5 decode steps; 3: all decoded
    assert all(t == ref for t, _ in res)


@pytest.mark.parametrize("world", (2, 3))
def test_ring_decode_baseline_gives_the_same_tokens(pools, reference, world):
    L_ok = L - L % (2 * world)
    ref = reference if L_ok == L else pools(1).run(_generate, "ring", 0.0, L_ok)[0][0]
    res = pools(world).run(_generate, "ring", 0.0, L_ok, "ring")
    assert all(t == ref for t, _ in res)
