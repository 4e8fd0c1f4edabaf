"""RoPE positions that follow the context-parallel layout, without editing Megatron's files.

Megatron's RotaryEmbedding slices its table with `get_pos_emb_on_this_cp_rank`, which hard-codes the zigzag
layout (and pins CPU memory, then calls .cuda()). `install_cp_rope` wraps the model's rotary embedding so that
it returns the full table indexed by `sequence_positions` of this rank's layout: zigzag for ring and burst
(the same rows Megatron would pick), cyclic for Attention2D.

Packed (THD) batches: Megatron's attention slices the table itself, per document, with the whole sequence's
cu_seqlens: for local row k of document i it reads row z_i(k), the zigzag position of that row inside the
document (TE's layout), or row cu_i + z_i(k) when the table has cu_seqlens[-1] rows. Positions restart in every
document (what --reset-position-ids means). For zigzag that is our layout: we return the full table, as
Megatron's own RotaryEmbedding does. For cyclic we return a table of cu_seqlens[-1] rows whose row
cu_i + z_i(k) holds the angle of the in-document position the cyclic layout puts at local row k; the model's
forward pre-hook (`install_cp_rope`) hands us its packed_seq_params for that. TE's fused THD RoPE
(--apply-rope-fusion) reads only in-document rows, so Attention2D with packed batches needs it off.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from ..algos.registry import layout_of
from ..sharding import layout_positions, sequence_positions
from .attention import packed_offsets


def gpt_of(model):
    """The GPTModel (the module holding `rotary_pos_emb`) inside wrappers (DDP, Float16Module: `.module`)."""
    while not hasattr(model, "rotary_pos_emb") and hasattr(model, "module"):
        model = model.module
    return model


def rope_rows(rope: nn.Module, positions: torch.Tensor) -> torch.Tensor:
    """[n, 1, 1, dim] on positions' device: the rows of `rope`'s (a RotaryEmbedding, or a RopeWrapper of one)
    table for positions [n], computed as Megatron's get_emb computes its table (the same values)."""
    inner = getattr(rope, "inner", rope)
    while isinstance(inner, RopeWrapper):
        inner = inner.inner
    seq = positions.to(device=inner.inv_freq.device, dtype=inner.inv_freq.dtype)
    if inner.seq_len_interpolation_factor is not None:
        seq = seq * (1 / inner.seq_len_interpolation_factor)
    freqs = torch.outer(seq, inner.inv_freq)                         # [n, dim / 2]
    if inner.rotary_interleaved:
        emb = torch.stack((freqs, freqs), dim=-1).view(freqs.shape[0], -1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :].to(positions.device)


class RopeWrapper(nn.Module):
    """A module in a GPTModel's `rotary_pos_emb` slot that wraps the model's own (`inner`): every attribute it
    does not have is the inner one's (Megatron calls get_rotary_seq_len, get_cos_sin, ... on the slot)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)


class CPRotaryEmbedding(RopeWrapper):
    """Wraps a megatron.core RotaryEmbedding: forward(max_seq_len, offset=0, packed_seq=False, cp_group=None)
    -> [s_local, 1, 1, dim], the rows of this CP rank's tokens in `algo`'s layout."""

    def __init__(self, inner: nn.Module, *, algo: str, cp_group, device_of=None, rope_fusion: bool = False):
        super().__init__(inner)
        self.algo, self.cp_group = algo, cp_group
        self._device = device_of                   # callable -> the model's device (None: the frequencies')
        self._cache: dict = {}
        self._packed_cache: tuple = (None, None)   # one packing at a time: every batch brings its own
        self.rope_fusion = rope_fusion             # the model's config.apply_rope_fusion
        self.packed_seq_params = None              # the model's current packed_seq_params (forward pre-hook)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        if packed_seq:
            return self._packed_table(max_seq_len, offset)
        key = (max_seq_len, offset, self._device() if self._device else None)
        if key not in self._cache:
            emb = self._full_table(max_seq_len, offset)
            size, rank = self.cp_group.size(), self.cp_group.rank()
            pos = sequence_positions(max_seq_len, algo=self.algo, rank=rank, world_size=size)
            self._cache[key] = emb.index_select(0, pos.to(emb.device))
        return self._cache[key]

    def _packed_table(self, max_seq_len: int, offset: int) -> torch.Tensor:
        """The table Megatron's THD RoPE slices (module docstring)."""
        size = self.cp_group.size()
        if size == 1 or layout_of(self.algo) == "zigzag":
            return self._full_table(max_seq_len, offset)
        if self.rope_fusion:
            raise ValueError(f"--apply-rope-fusion: TE's fused RoPE of packed (THD) batches assumes the zigzag layout; "
                             f"{self.algo} is cyclic: run with --no-rope-fusion")
        if self.packed_seq_params is None:
            raise ValueError("packed_seq_params: the packed RoPE table of a cyclic layout needs the model's "
                             "packed_seq_params (install_cp_rope's pre-hook saw none: pass it as a keyword)")
        offs = packed_offsets(self.packed_seq_params)
        key = (offs, offset, self._device() if self._device else None)
        if self._packed_cache[0] != key:
            total, rank = offs[-1], self.cp_group.rank()
            full = self._full_table(max(b - a for a, b in zip(offs, offs[1:])), offset)
            starts = torch.tensor(offs[:-1]).repeat_interleave(torch.tensor(offs[1:]) - torch.tensor(offs[:-1]))
            read = layout_positions(total, "zigzag", rank=rank, world_size=size, cu_seqlens=offs)  # Megatron's rows
            mine = sequence_positions(total, algo=self.algo, rank=rank, world_size=size, cu_seqlens=offs)
            table = full.new_zeros((total,) + tuple(full.shape[1:]))
            table[read.to(full.device)] = full[(mine - starts[mine]).to(full.device)]
            self._packed_cache = (key, table)
        return self._packed_cache[1]

    def _full_table(self, max_seq_len: int, offset: int) -> torch.Tensor:
        """[S, 1, 1, dim] for the whole sequence, as Megatron's get_emb, on the model's device (get_emb would
        move the frequencies to CUDA unconditionally, which fails without a GPU and misplaces CPU models)."""
        device = self._device() if self._device else self.inner.inv_freq.device
        return rope_rows(self.inner, torch.arange(offset, offset + max_seq_len, device=device))


def install_cp_rope(model, *, algo: str, cp_group):
    """Make `model`'s (a GPTModel, possibly wrapped) rotary embedding give this rank's positions; returns model."""
    m = gpt_of(model)
    rope = getattr(m, "rotary_pos_emb", None)
    if rope is not None and not isinstance(rope, CPRotaryEmbedding):
        owner = m
        m.rotary_pos_emb = CPRotaryEmbedding(rope, algo=algo, cp_group=cp_group,
                                             device_of=lambda: next(owner.parameters()).device,
                                             rope_fusion=bool(getattr(getattr(m, "config", None),
                                                                      "apply_rope_fusion", False)))
        m.register_forward_pre_hook(_remember_packing, with_kwargs=True)
    return model


def _remember_packing(module, args, kwargs):
    """Forward pre-hook of the GPTModel: its packed_seq_params (None for unpacked batches) for the RoPE table."""
    try:
        params = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments.get("packed_seq_params")
    except TypeError:
        params = kwargs.get("packed_seq_params")
    module.rotary_pos_emb.packed_seq_params = params
