"""megatron-cp-plugin: exact context-parallel attention for Megatron-LM (public API)."""
from . import quiet as _quiet

_quiet.install()        # before anything imports megatron-core: its TE / Apex fallback warnings (quiet.py)
from .algos import ALGORITHMS, context_parallel_attention
from .algos.tree_decode import tree_decode
from .comm import CommStats
from .cp_grid import CPGrid, attention2d_bytes, choose_grid
from .sharding import (document_unit, pad_documents, pad_packed, sequence_positions, shard_sequence,
                       unshard_sequence)

__all__ = ["ALGORITHMS", "CPGrid", "CommStats", "attention2d_bytes", "choose_grid", "context_parallel_attention",
           "document_unit", "pad_documents", "pad_packed", "sequence_positions", "shard_sequence", "tree_decode",
           "unshard_sequence"]
__version__ = "0.1.0"
