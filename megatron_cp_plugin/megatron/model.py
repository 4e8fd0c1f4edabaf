"""Building a Megatron GPTModel that runs context-parallel attention with our spec and RoPE positions."""
from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

from .args import CPConfig
from .rope import install_cp_rope
from .spec import get_gpt_layer_spec


def build_gpt(config: TransformerConfig, cp: CPConfig, *, vocab_size: int, seq_length: int, cp_group,
              position_embedding_type: str = "rope", use_te: bool | None = None, pg_collection=None) -> GPTModel:
    """GPTModel with CPCoreAttention(cp.algo) in every layer and RoPE positions in the algorithm's layout."""
    spec = get_gpt_layer_spec(cp.algo, grid=cp.grid, gpus_per_node=cp.gpus_per_node,
                              group_tokens=cp.group_tokens, use_te=use_te,
                              normalization=config.normalization)
    kw = {"pg_collection": pg_collection} if pg_collection is not None else {}
    model = GPTModel(config, spec, vocab_size=vocab_size, max_sequence_length=seq_length,
                     position_embedding_type=position_embedding_type, **kw)
    return install_cp_rope(model, algo=cp.algo, cp_group=cp_group)


def tiny_config(*, cp_size: int, num_layers: int = 2, hidden: int = 64, heads: int = 8, groups: int = 2,
                ffn: int = 128, dtype=torch.float32) -> TransformerConfig:
    """A small fp32 GPT config for CPU tests and demos (no dropout: context-parallel attention has none)."""
    return TransformerConfig(num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads,
                             num_query_groups=groups, ffn_hidden_size=ffn, use_cpu_initialization=True,
                             attention_dropout=0.0, hidden_dropout=0.0, context_parallel_size=cp_size,
                             params_dtype=dtype, normalization="RMSNorm")
