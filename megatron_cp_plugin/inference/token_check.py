"""The random model that token-equality checks decode with, and the check that its greedy tokens vary.

A check that two runs give the same greedy tokens (graphed = eager, CP = P = CP = 1) catches a wrong merge
only where the tokens depend on what attention returns. With Megatron's initialisation (std 0.02) they hardly
do, for two reasons:
  * a layer's attention scores have std about 0.02^2 x hidden (0.03 at hidden 64, 0.1 at 256, 1.6 at 4096), so
    each query averages nearly every key and that average barely moves as the context grows;
  * GELU's output has a positive mean, which fc2 turns into a fixed vector per layer: the same for every token
    and context, and larger the wider the model (fc1's outputs have std 0.02 x sqrt(hidden)). Its sum over the
    layers favours a few tokens whatever the input.
The next token is then a function of the last one or a constant, and greedy decoding falls into a short cycle
or a fixed point: the 32-layer, hidden 4096 model of scripts/gpu_decode_check.sh gave token 251 thirty-two times.

`vary_greedy_tokens_` rescales each layer's Q and K rows so that the scores have std SCORE_STD whatever the
hidden size (attention then picks a few keys by content and by RoPE's relative position, which moves with every
new token), and centres each row of fc2's weight (its sum over the FFN outputs zero), which removes the fixed
vector. The weights stay random; only their scale and mean change, so timings are unaffected. Distinct tokens
among 32 greedy tokens, measured:
  32 layers x hidden 4096 (H200, fp32, CP = 1, graphed; B's 4k text prompt, 4k and 16k random ids):
      Megatron's init 1, 2, 1; Q, K at std 6 alone 15, 11, 17; std 3 alone 8, 12, 11; std 12 alone 20, 19, 22;
      with fc2 centred: std 4 24, 31, 29; std 6 (SCORE_STD) 28, 31, 32; std 9 27, 32, 31.
  CPU, fp32, 64-token random prompt, 3 seeds: 32 x 256 Megatron 8-15, this 24-27; 8 x 256 2-11, this 26-31;
      2 x 64 (the tests' models) 3-24, this 27-30.
"""
from __future__ import annotations

import math

import torch

SCORE_STD = 6.0
"""Target std of the attention scores q.k / sqrt(d) of the token-check model: distinct tokens above, and a
margin against rounding (CP = 2 and CP = 1 sum in different orders), the smallest top-1 - top-2 logit gap over
fp32's largest logit error against fp64 (CPU, 3 seeds, fc2 centred): 32 x 256 at std 6: 11-520, 8 x 256:
160-420, 2 x 64: 340-8600. Sharper is chaotic: 32 x 256 with Q, K at std 26 gave a margin of 0.03 (rounding
decides tokens)."""

MIN_DISTINCT = 16
"""Distinct tokens a token-equality check needs among 32 greedy tokens (half; the same fraction for other counts,
at least 2). The token-check model gave 23-32 everywhere measured (above; the tests' prompts 23-31). What it
replaces gave 1-2 at the 8B shape and, on the tests' 2-layer model (QKV x 4), 8-17: cycles of a few tokens,
which a quarter (8) would have let through."""


def min_distinct(n: int) -> int:
    """Distinct tokens needed among n compared greedy tokens: MIN_DISTINCT of 32 pro rata, at least 2 (n > 1)."""
    return min(n, max(2, math.ceil(n * MIN_DISTINCT / 32)))


def variety(tokens) -> str | None:
    """None when every row of `tokens` ([rows][n] or [n] ids) has min_distinct(n) distinct tokens, else the
    one-line reason a token-equality check over them proves nothing."""
    rows = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    if rows and not isinstance(rows[0], (list, tuple)):
        rows = [rows]
    for i, row in enumerate(rows):
        need = min_distinct(len(row))
        if len(set(row)) < need:
            return (f"greedy tokens do not vary: row {i} has {len(set(row))} distinct of {len(row)} (need {need}), "
                    "so equal tokens cannot show a wrong merge")
    return None


def distinct(tokens) -> list[int]:
    """Distinct tokens per row."""
    rows = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    if rows and not isinstance(rows[0], (list, tuple)):
        rows = [rows]
    return [len(set(r)) for r in rows]


@torch.no_grad()
def vary_greedy_tokens_(model, score_std: float = SCORE_STD):
    """Make a GPTModel's seeded random weights give greedy tokens that vary (see the module), in place: each
    layer's Q and K rows of the fused QKV weight scaled so that the scores of an RMS-normalised input have std
    `score_std`, each row of fc2's weight centred. Returns the model. For random weights only (callers leave a
    trained checkpoint as it is). Ranks holding the same weights change them the same way (the factors come
    from the weights, in fp64); under TP each rank centres its own slice of fc2's rows, whose sum is then zero."""
    from ..megatron.rope import gpt_of

    cfg = gpt_of(model).config
    tp = cfg.tensor_model_parallel_size
    heads = cfg.num_attention_heads // tp
    groups = (cfg.num_query_groups or cfg.num_attention_heads) // tp
    d = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
    per = heads // groups
    for name, w in model.named_parameters():
        if name.endswith("linear_fc2.weight"):
            w.sub_(w.mean(dim=1, keepdim=True))                     # [hidden, ffn]: no fixed output vector
        if not name.endswith("linear_qkv.weight"):
            continue
        rows = w.view(groups, per + 2, d, w.shape[-1])              # per group: its q heads, k, v (Megatron)
        q, k = rows[:, :per], rows[:, per]
        # score = q.k / sqrt(d) with q_j = W_q[j].x, x of RMS 1: var(score) = mean |W_q[j]|^2 x mean |W_k[j]|^2
        now = math.sqrt(q.double().pow(2).sum(-1).mean().item() * k.double().pow(2).sum(-1).mean().item())
        f = math.sqrt(score_std / now)
        q.mul_(f)
        k.mul_(f)
    return model
