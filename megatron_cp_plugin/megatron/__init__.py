"""Megatron integration: core-attention module, layer spec, flags, batch sharding, RoPE positions, CP loss.

The modules that subclass megatron-core's (attention, rope, spec) load on first use: importing megatron-core
takes ~5 s on a CPU, and the launching process (flags, start-up checks) needs only `args` and `batch`."""
from __future__ import annotations

import importlib

from .args import CPConfig, add_cp_args, config_from_args, resolve_algo
from .batch import cp_token_mean_loss, pack_documents, packed_seq_params, packed_unit, shard_batch

_LAZY = {"CPCoreAttention": "attention", "CPRotaryEmbedding": "rope", "install_cp_rope": "rope",
         "get_gpt_layer_spec": "spec"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CPConfig", "CPCoreAttention", "CPRotaryEmbedding", "add_cp_args", "config_from_args",
           "cp_token_mean_loss", "get_gpt_layer_spec", "install_cp_rope", "pack_documents", "packed_seq_params",
           "packed_unit", "resolve_algo", "shard_batch"]
