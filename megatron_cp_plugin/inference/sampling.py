"""Sampling on the device, with no host read-back: greedy, and temperature / top-p from counter-based random
numbers, so a CUDA graph can capture it and every rank and CP size draws the same token.

    tok = sample(logits [b, vocab] fp32, temperature=0.8, top_p=0.9, seed=5, key=position [1] int64)   # [b]

The draw is an exponential race: with E_i ~ Exp(1) independent, argmax_i p_i / E_i is token i with probability
p_i / sum(p) (the same trick torch.multinomial uses for one sample, but torch.multinomial first checks the
distribution on the host, a read-back a graph capture forbids). E_i = -log(u_i), where u_i is a hash of
(seed, key, row, token): `key` is the position the new token will take, so eager decoding, a graph replay, any
CP size and any rank draw the same numbers for the same token.
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B        # < 2^27: products of 32-bit values stay below 2^59, exact in int64 on every device


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two xor-shift-multiply rounds) of int64 values in [0, 2^32)."""
    x = (((x >> 16) ^ x) * _MUL) & _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    return (x >> 16) ^ x


def uniform(seed: int, key: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """[b, n] fp32 uniforms in (0, 1), a function of (seed, key [1] int64 on the device, element index) only."""
    b, n = shape
    idx = torch.arange(b * n, device=key.device, dtype=torch.int64).view(b, n)
    base = _mix32((_mix32(torch.full_like(key, seed & _M32)) ^ (key & _M32)) & _M32)
    x = _mix32(_mix32(base ^ (idx & _M32)) ^ ((idx >> 32) & _M32))
    return ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))       # 24 random bits, never 0 or 1


def top_p_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """softmax(logits / temperature) restricted to the smallest set of tokens reaching probability top_p
    (unnormalised: the race does not need it)."""
    probs = torch.softmax(logits.float() / temperature, -1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p                 # the tokens before reaching top_p, and it
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p * keep)
    return probs


def check_sampling(temperature: float, top_p: float) -> None:
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def sample(logits: torch.Tensor, *, temperature: float, top_p: float, seed: int, key: torch.Tensor) -> torch.Tensor:
    """logits [b, vocab] -> token ids [b] int64 on the device; greedy (argmax) when temperature == 0."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = top_p_probs(logits, temperature, top_p)
    race = probs / -torch.log(uniform(seed, key, tuple(probs.shape)))
    return race.argmax(-1)
