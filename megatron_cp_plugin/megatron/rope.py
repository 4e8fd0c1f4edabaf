"""RoPE positions that follow the context-parallel layout, without editing Megatron's files.

Megatron's RotaryEmbedding slices its table with `get_pos_emb_on_this_cp_rank`, which hard-codes the zigzag
layout (and pins CPU memory, then calls .cuda()). `install_cp_rope` wraps the model's rotary embedding so that
it returns the full table indexed by `sequence_positions` of this rank's layout: zigzag for ring and burst
(the same rows Megatron would pick), cyclic for Attention2D.
"""
from __future__ import annotations

import torch
from torch import nn

from ..sharding import sequence_positions


class CPRotaryEmbedding(nn.Module):
    """Wraps a megatron.core RotaryEmbedding: forward(max_seq_len, offset=0, packed_seq=False, cp_group=None)
    -> [s_local, 1, 1, dim], the rows of this CP rank's tokens in `algo`'s layout."""

    def __init__(self, inner: nn.Module, *, algo: str, cp_group, device_of=None):
        super().__init__()
        self.inner, self.algo, self.cp_group = inner, algo, cp_group
        self._device = device_of                   # callable -> the model's device (None: the frequencies')
        self._cache: dict = {}

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        if packed_seq:
            raise ValueError("packed (THD) sequences are not supported by context-parallel attention yet")
        state = getattr(self, "decode_state", None)
        if state is not None and state.mode == "decode":          # the one token being decoded
            return self._full_table(1, state.position)
        key = (max_seq_len, offset, self._device() if self._device else None)
        if key not in self._cache:
            emb = self._full_table(max_seq_len, offset)
            size, rank = self.cp_group.size(), self.cp_group.rank()
            pos = sequence_positions(max_seq_len, algo=self.algo, rank=rank, world_size=size)
            self._cache[key] = emb.index_select(0, pos.to(emb.device))
        return self._cache[key]

    def _full_table(self, max_seq_len: int, offset: int) -> torch.Tensor:
        """[S, 1, 1, dim] for the whole sequence, as Megatron's get_emb, on the model's device (get_emb would
        move the frequencies to CUDA unconditionally, which fails without a GPU and misplaces CPU models)."""
        inner = self.inner
        freqs = inner.get_freqs_non_repeated(max_seq_len, offset)      # [S, dim / 2]
        if inner.rotary_interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).view(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :].to(self._device() if self._device else emb.device)

    def __getattr__(self, name):                                   # get_rotary_seq_len, get_cos_sin, ...
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)


def install_cp_rope(model, *, algo: str, cp_group):
    """Make `model`'s (a GPTModel, possibly wrapped) rotary embedding give this rank's positions; returns model."""
    m = model
    while not hasattr(m, "rotary_pos_emb") and hasattr(m, "module"):
        m = m.module
    rope = getattr(m, "rotary_pos_emb", None)
    if rope is not None and not isinstance(rope, CPRotaryEmbedding):
        owner = m
        m.rotary_pos_emb = CPRotaryEmbedding(rope, algo=algo, cp_group=cp_group,
                                             device_of=lambda: next(owner.parameters()).device)
    return model
