"""megatron-cp-plugin: exact context-parallel attention for Megatron-LM (public API)."""
from .algos import ALGORITHMS, context_parallel_attention
from .comm import CommStats, CPGrid, attention2d_bytes, choose_grid
from .sharding import sequence_positions, shard_sequence, unshard_sequence

__all__ = ["ALGORITHMS", "CPGrid", "CommStats", "attention2d_bytes", "choose_grid", "context_parallel_attention",
           "sequence_positions", "shard_sequence", "unshard_sequence"]
__version__ = "0.1.0"
