"""Generation with a sequence-sharded KV cache: prefill with a training algorithm, decode with tree_decode."""
from .generate import DecodeState, generate, install_decode_state

__all__ = ["DecodeState", "generate", "install_decode_state"]
