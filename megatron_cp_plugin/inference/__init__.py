"""Generation with a sequence-sharded KV cache: prefill with a training algorithm, decode with tree_decode;
`StaticDecoder` runs the decode step as one CUDA graph per token (inference/static.py)."""
from .generate import DecodeState, generate, install_decode_state
from .static import StaticDecoder

__all__ = ["DecodeState", "StaticDecoder", "generate", "install_decode_state"]
