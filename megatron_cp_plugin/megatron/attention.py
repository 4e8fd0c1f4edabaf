"""The core-attention module for Megatron's `self_attention.submodules.core_attention` slot.

Megatron hands it this rank's shard of the sequence, RoPE applied: query [sq, b, np, hn], key and value
[sk, b, ng, hn] (GQA not expanded); it returns [sq, b, np * hn]. The shard is in the layout of the
algorithm (zigzag for ring and burst, cyclic for Attention2D): `batch.shard_batch` and `rope.install_cp_rope`
make the data and the positions agree with it.

Packed sequences (`packed_seq_params`, qkv_format "thd"): query [t, np, hn], key and value [t, ng, hn] hold
this rank's part of every document, each in the algorithm's layout (`shard_batch` of a packed batch); the
boundaries are the whole sequence's cu_seqlens (cu_seqlens_q_padded when given: the tokens are laid out by
it), and the output is [t, np * hn]. Attention stays inside each document.

Generation keeps this module as it is: inference/hooks.py puts stand-ins in its slot for a forward (the
prefill that keeps K, V, the decode steps).
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from ..algos import context_parallel_attention, registry
from ..cp_grid import get_grid
from ..sharding import document_offsets


class CPCoreAttention(MegatronModule):
    """Exact context-parallel attention over `pg_collection.cp` with `algo` (see megatron_cp_plugin.ALGORITHMS).

    grid: (rows, cols) for Attention2D (None: `choose_grid`); gpus_per_node: node-aware grid placement;
    group_tokens: Attention2D's cap on one grouped kernel call's query tokens (None: cp_grid.GROUP_TOKENS' rule).
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, *, algo: str,
                 grid: tuple[int, int] | None = None, gpus_per_node: int | None = None,
                 group_tokens: int | None = None, backend: str | None = None):
        super().__init__(config=config)
        row = registry.get(algo)                                 # ValueError for an unknown algo
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"attention_dropout = {dropout}: context-parallel attention has no dropout; "
                             "set --attention-dropout 0")
        if attention_type != "self":
            raise ValueError(f"attention_type={attention_type!r}: only self-attention is context-parallel")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise ValueError(f"attn_mask_type={attn_mask_type.name}: supported are causal and no_mask")
        self.algo, self.backend, self.attn_mask_type = algo, backend, attn_mask_type
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.softmax_scale
        cp = pg_collection.cp if pg_collection is not None else parallel_state.get_context_parallel_group()
        self.group = cp
        if row.grid:                                             # built now, on every CP rank in step
            tp = getattr(config, "tensor_model_parallel_size", 1) or 1      # the heads this rank holds
            h = config.num_attention_heads // tp
            h_kv = max(1, (config.num_query_groups or config.num_attention_heads) // tp)
            shape = grid or row.grid_shape(torch.distributed.get_world_size(cp), h, h_kv)
            self.group = get_grid(cp, shape, gpus_per_node=gpus_per_node, group_tokens=group_tokens)

    def forward(self, query, key, value, attention_mask, /, *, attn_mask_type: AttnMaskType | None = None,
                attention_bias=None, packed_seq_params=None):
        """query [sq, b, np, hn], key, value [sk, b, ng, hn] -> [sq, b, np * hn]."""
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if packed_seq_params is not None and mask_type == AttnMaskType.padding_causal:
            mask_type = AttnMaskType.causal           # TE's name for causal inside every document of a THD batch
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by context-parallel attention")
        if mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise ValueError(f"attn_mask_type={mask_type.name}: supported are causal and no_mask")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params, mask_type == AttnMaskType.causal)
        if query.shape[0] != key.shape[0]:
            raise ValueError(f"query has {query.shape[0]} tokens and key {key.shape[0]}: Megatron's own KV cache is "
                             "not context-parallel; generate with megatron_cp_plugin.inference (tree decoding)")
        q, k, v = (x.transpose(0, 1) for x in (query, key, value))  # [b, s, h, d] views
        o = context_parallel_attention(q, k, v, algo=self.algo, group=self.group,
                                       causal=mask_type == AttnMaskType.causal, softmax_scale=self.softmax_scale,
                                       backend=self.backend)
        return o.transpose(0, 1).reshape(query.shape[0], query.shape[1], -1)

    def _packed(self, query, key, value, params, causal: bool):
        """THD: query [t, np, hn] (or [t, 1, np, hn]), key, value [t, ng, hn] -> [t, np * hn]."""
        q, k, v = (x.transpose(0, 1) if x.dim() == 4 else x.unsqueeze(0) for x in (query, key, value))
        if q.shape[0] != 1:
            raise ValueError(f"packed_seq_params: THD input has batch 1, got query {tuple(query.shape)}")
        o = context_parallel_attention(q, k, v, algo=self.algo, group=self.group, causal=causal,
                                       softmax_scale=self.softmax_scale, backend=self.backend,
                                       cu_seqlens=packed_offsets(params))
        return o[0].reshape(o.shape[1], -1)


def packed_offsets(params) -> tuple[int, ...]:
    """The whole sequence's document boundaries of a THD PackedSeqParams as host ints: cu_seqlens_q_padded when
    given, else cu_seqlens_q (which must equal the kv ones: self-attention). Read from the device once per
    PackedSeqParams object and kept on it (or set by `batch.packed_seq_params`), so every layer reuses them."""
    offs = getattr(params, "_cp_offsets", None)
    if offs is not None:
        return offs
    if params.qkv_format != "thd":
        raise ValueError(f"packed_seq_params: qkv_format={params.qkv_format!r}, context-parallel attention takes "
                         f"'thd'")
    q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    kv = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
    if q is None:
        raise ValueError("packed_seq_params: cu_seqlens_q is None")
    flat = lambda x: x.flatten() if isinstance(x, torch.Tensor) else x  # noqa: E731 (Megatron's [1, n] too)
    offs = document_offsets(flat(q))
    if kv is not None and kv is not q and document_offsets(flat(kv)) != offs:
        raise ValueError("packed_seq_params: cu_seqlens_q and cu_seqlens_kv differ; self-attention needs one set")
    params._cp_offsets = offs
    return offs
