"""Generation with the KV cache sharded over the context-parallel group.

Prefill runs the prompt through the model with a training algorithm (ring, burst, attention2d); each rank's
`CPCoreAttention` keeps the K, V of its own prompt tokens (in that algorithm's layout) and their global
positions. Each decode step feeds the one new token, replicated on every rank: every layer appends the new
token's K, V to the shard of rank `position mod P` (round-robin, so shards stay within one token of each
other) and attends with `tree_decode`; the logits are then identical on every rank, so is the sampled token.
No rank ever holds another rank's part of the cache.

    state = DecodeState(cp_group)
    install_decode_state(model, state)          # after install_cp_rope; training is unaffected while idle
    tokens = generate(model, prompt [b, L], max_new_tokens=32, state=state, algo="ring")   # [b, 32]
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..algos import registry
from ..sharding import sequence_positions


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
    """Shared by every layer's core attention and the RoPE wrapper of one model during generation.

    mode: None (training / plain forward), "prefill" or "decode"; position: the global position of the token
    being decoded; cache: layer number -> KVShard (this rank's part only). reserve: decode tokens to
    preallocate room for (generate() sets it from max_new_tokens).
    decoder: "tree" (tree_decode, `variant`) or "ring" (the ring-decode baseline: K, V shards go round).
    """

    def __init__(self, cp_group, variant: str | None = None, decoder: str = "tree"):
        if decoder not in ("tree", "ring"):
            raise ValueError(f"decoder must be 'tree' or 'ring' (the ring-decode baseline), got {decoder!r}")
        self.cp_group, self.variant, self.decoder = cp_group, variant, decoder
        self.mode: str | None = None
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
    """Point every CPCoreAttention and the CP RoPE wrapper of `model` at `state`; returns model."""
    from ..megatron.attention import CPCoreAttention
    from ..megatron.rope import CPRotaryEmbedding

    for m in model.modules():
        if isinstance(m, (CPCoreAttention, CPRotaryEmbedding)):
            m.decode_state = state
    return model


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
    L0 = L - L % registry.divisor(algo, P)
    state.mode, state.cache, state.reserve = "prefill", {}, L - L0 + max_new_tokens
    row = None
    if L0:
        # Prefill: the prompt in the algorithm's layout; each layer keeps its shard of K, V.
        pos = sequence_positions(L0, algo=algo, rank=rank, world_size=P).to(dev)
        logits = model(prompt[:, :L0].index_select(1, pos), pos.expand(b, -1), None)   # [b, L0 / P, vocab]
        last = (pos == L0 - 1).nonzero()
        row = (logits[:, last[0, 0]].float().contiguous() if len(last)
               else torch.zeros(b, logits.shape[-1], device=dev))
        if P > 1:
            dist.all_reduce(row, group=group)                          # the last prefilled token's owner's row
    gen = torch.Generator(device=dev).manual_seed(seed)
    out = []
    state.mode = "decode"
    try:
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
            logits = model(tok[:, None], torch.full((b, 1), position, device=dev, dtype=torch.long), None)
            row = logits[:, -1].float()
    finally:
        state.mode = None
    return torch.stack(out, 1)
