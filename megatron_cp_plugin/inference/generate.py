"""Generation with the KV cache sharded over the context-parallel group.

Prefill runs the prompt through the model with a training algorithm (ring, burst, attention2d); each rank's
`CPCoreAttention` keeps the K, V of its own prompt tokens (in that algorithm's layout) and their global
positions. Each decode step feeds the one new token, replicated on every rank: every layer appends the new
token's K, V to the shard of rank `position mod P` (round-robin, so shards stay within one token of each
other) and attends with `tree_decode`; the logits are then identical on every rank, so is the sampled token.
No rank ever holds another rank's part of the cache.

    state = DecodeState(cp_group)
    tokens = generate(model, prompt [b, L], max_new_tokens=32, state=state, algo="ring")   # [b, 32]

The model's modules are left as they are: each forward of generation runs with stand-ins in the attention and
RoPE slots (inference/hooks.py), the same way as the static and the tree decoders.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..algos import registry
from ..algos.ring_decode import ring_decode
from ..algos.tree_decode import tree_decode
from ..sharding import sequence_positions
from .hooks import KeepPrefill, PositionRope, core_owners, swapped


class KVShard:
    """One layer's cache shard on this rank, preallocated: k, v [b, capacity, h_kv, d], pos [b, capacity]
    (-1 = empty slot) and the fill `n`. Appending writes in place (no torch.cat copy of the whole shard per
    token); when full, the capacity doubles, so a long generation copies each token O(1) times."""

    def __init__(self, k, v, pos, capacity: int):
        b, s, h_kv, d = k.shape
        capacity = max(capacity, s, 1)
        # Zeros, not new_empty: the ring-decode baseline attends over whole padded shards, and a masked slot
        # still enters P V as 0 x V, which is NaN when the uninitialised memory holds a NaN pattern (it
        # flipped greedy tokens at P = 3 on CI's CPU).
        self.k = k.new_zeros(b, capacity, h_kv, d)
        self.v = v.new_zeros(b, capacity, h_kv, d)
        self.pos = torch.full((b, capacity), -1, dtype=torch.long, device=k.device)
        self.k[:, :s], self.v[:, :s], self.pos[:, :s] = k, v, pos
        self.n = s

    def reserve(self, n: int):
        if n > self.k.shape[1]:
            cap = max(n, 2 * self.k.shape[1])
            old = (self.k, self.v, self.pos)
            self.k, self.v = (x.new_zeros(x.shape[0], cap, *x.shape[2:]) for x in old[:2])
            self.pos = torch.full((old[2].shape[0], cap), -1, dtype=torch.long, device=old[2].device)
            for new, o in zip((self.k, self.v, self.pos), old):
                new[:, :self.n] = o[:, :self.n]

    def push(self, k, v, position: int):
        """Append one token's k, v [b, 1, h_kv, d] at global `position`."""
        self.reserve(self.n + 1)
        self.k[:, self.n], self.v[:, self.n] = k[:, 0], v[:, 0]
        self.pos[:, self.n] = position
        self.n += 1

    def view(self, length: int | None = None):
        """(k, v [b, length, h_kv, d], pos [b, length]) views; slots past the fill have pos -1 (padding)."""
        length = self.n if length is None else length
        self.reserve(length)
        return self.k[:, :length], self.v[:, :length], self.pos[:, :length]


class DecodeState:
    """What every layer's decode step shares during one generation.

    position: the global position of the token being decoded; cache: layer number -> KVShard (this rank's part
    only). reserve: decode tokens to preallocate room for (generate() sets it from max_new_tokens).
    decoder: "tree" (tree_decode, `variant`) or "ring" (the ring-decode baseline: K, V shards go round).
    """

    def __init__(self, cp_group, variant: str | None = None, decoder: str = "tree"):
        if decoder not in ("tree", "ring"):
            raise ValueError(f"decoder must be 'tree' or 'ring' (the ring-decode baseline), got {decoder!r}")
        self.cp_group, self.variant, self.decoder = cp_group, variant, decoder
        self.position = 0
        self.reserve = 0
        self.cache: dict[int, KVShard] = {}

    def _room(self, prefilled: int) -> int:
        return prefilled + -(-self.reserve // self.cp_group.size()) + 1

    def store_prefill(self, layer: int, k, v, positions):
        self.cache[layer] = KVShard(k.detach(), v.detach(), positions.expand(k.shape[0], -1),
                                    self._room(k.shape[1]))

    def append(self, layer: int, k, v):
        """Add the decoded token's k, v [b, 1, h_kv, d] to this rank's shard when it owns the position;
        returns the shard's (k, v, positions) views."""
        if layer not in self.cache:                              # nothing was prefilled
            self.cache[layer] = KVShard(k[:, :0], v[:, :0], torch.zeros(k.shape[0], 0, dtype=torch.long,
                                                                        device=k.device), self._room(0))
        shard = self.cache[layer]
        if self.position % self.cp_group.size() == self.cp_group.rank():
            shard.push(k, v, self.position)
        return shard.view()


def install_decode_state(model, state: DecodeState):
    """Check that `model` (a GPTModel from build_gpt, possibly wrapped) can be decoded with `state`: its layers'
    core attention is CPCoreAttention. generate() checks it too, so calling this first is optional; returns model."""
    from ..megatron.attention import CPCoreAttention

    if not any(isinstance(m.core_attention, CPCoreAttention) for m in core_owners(model)):
        raise ValueError("model: no CPCoreAttention layers (build it with megatron_cp_plugin.megatron.build_gpt)")
    if not isinstance(state, DecodeState):
        raise ValueError(f"state must be a DecodeState, got {type(state).__name__}")
    return model


class _DecodeCore(torch.nn.Module):
    """A layer's core attention during an eager decode step: one new token [1, b, ., hn], replicated; its K, V
    go to the shard of rank position mod P, and it attends with tree decoding (or the ring-decode baseline)."""

    def __init__(self, inner, state: DecodeState):
        super().__init__()
        self.inner, self.state = inner, state

    def forward(self, query, key, value, attention_mask=None, **_):
        state, layer, scale = self.state, self.inner.layer_number, self.inner.softmax_scale
        q, k, v = (x.transpose(0, 1) for x in (query, key, value))
        ck, cv, cpos = state.append(layer, k, v)
        if state.decoder == "ring":                   # the baseline: every shard padded to the longest, passed round
            ck, cv, cpos = state.cache[layer].view(-(-(state.position + 1) // state.cp_group.size()))
            o = ring_decode(q, ck, cv, group=state.cp_group, softmax_scale=scale, kv_positions=cpos)
        else:
            kw = {"variant": state.variant} if state.variant else {}
            o = tree_decode(q, ck, cv, group=state.cp_group, softmax_scale=scale, validate=False, **kw)
        return o.transpose(0, 1).reshape(query.shape[0], query.shape[1], -1)


def _sample(logits, temperature: float, top_p: float, generator):
    """logits [b, vocab] fp32 -> token ids [b]; greedy when temperature == 0."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, -1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p                 # the smallest set reaching top_p
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p * keep)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model, prompt: torch.Tensor, *, max_new_tokens: int, state: DecodeState, algo: str,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, on_token=None) -> torch.Tensor:
    """prompt [b, L] (the same on every rank) -> the new tokens [b, max_new_tokens], identical on every rank.

    The longest prefix of the prompt that the algorithm's layout can shard (a multiple of 2P for ring and
    burst, of P for Attention2D) is prefilled in parallel; the rest of the prompt goes through decode steps.
    on_token(step, tokens [b]) is called for every new token (for streaming and latency measurement).
    """
    group = state.cp_group
    P, rank = group.size(), group.rank()
    b, L = prompt.shape
    dev = prompt.device
    model.eval()
    install_decode_state(model, state)
    L0 = L - L % registry.divisor(algo, P)
    state.cache, state.reserve = {}, L - L0 + max_new_tokens
    row = None
    if L0:
        # Prefill: the prompt in the algorithm's layout; each layer keeps its shard of K, V.
        pos = sequence_positions(L0, algo=algo, rank=rank, world_size=P).to(dev)
        with swapped(model, core=lambda c, i: KeepPrefill(c, state.store_prefill, group)):
            logits = model(prompt[:, :L0].index_select(1, pos), pos.expand(b, -1), None)   # [b, L0 / P, vocab]
        last = (pos == L0 - 1).nonzero()
        row = (logits[:, last[0, 0]].float().contiguous() if len(last)
               else torch.zeros(b, logits.shape[-1], device=dev))
        if P > 1:
            dist.all_reduce(row, group=group)                          # the last prefilled token's owner's row
    gen = torch.Generator(device=dev).manual_seed(seed)
    out = []
    position_t = torch.zeros(1, dtype=torch.long, device=dev)           # the RoPE row of the token being decoded
    with swapped(model, core=lambda c, i: _DecodeCore(c, state), rope=lambda r: PositionRope(r, position_t)):
        for position in range(L0, L + max_new_tokens):
            if position >= L:                                          # a new token from the last logits
                tok = _sample(row, temperature, top_p, gen)
                out.append(tok)
                if on_token is not None:
                    on_token(len(out) - 1, tok)
                if len(out) == max_new_tokens:
                    break
            else:                                                      # the prompt's tail, one token a step
                tok = prompt[:, position]
            state.position = position
            position_t.fill_(position)
            logits = model(tok[:, None], torch.full((b, 1), position, device=dev, dtype=torch.long), None)
            row = logits[:, -1].float()
    return torch.stack(out, 1)
