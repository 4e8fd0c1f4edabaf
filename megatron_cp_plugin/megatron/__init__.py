"""Megatron integration: core-attention module, layer spec, flags, batch sharding, RoPE positions, CP loss."""
from .args import CPConfig, add_cp_args, config_from_args, resolve_algo
from .attention import CPCoreAttention
from .batch import cp_token_mean_loss, pack_documents, packed_seq_params, packed_unit, shard_batch
from .rope import CPRotaryEmbedding, install_cp_rope
from .spec import get_gpt_layer_spec

__all__ = ["CPConfig", "CPCoreAttention", "CPRotaryEmbedding", "add_cp_args", "config_from_args",
           "cp_token_mean_loss", "get_gpt_layer_spec", "install_cp_rope", "pack_documents", "packed_seq_params",
           "packed_unit", "resolve_algo", "shard_batch"]
