"""`megatron-cp-pretrain` / `python -m megatron_cp_plugin.pretrain`: GPT pretraining with context-parallel
attention. The trainer lives in `megatron_cp_plugin.training` (one module per concern); this module is the
entry point and keeps the names other code imported from it. Trainer and train load on first use, so the
launching process does not import megatron-core (~5 s on a CPU) before it starts the ranks."""
from __future__ import annotations

import importlib

from .training.config import (build_parser, load_config_files, parse_args, parse_with_configs, recompute_kwargs,
                              transformer_config, validate_args)
from .training.launch import compare_cp1, launch, main, run_rank
from .training.report import flops_per_iter, memory_gb

_LAZY = {"Trainer": "trainer", "train": "loop"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".training.{_LAZY[name]}", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Trainer", "build_parser", "compare_cp1", "flops_per_iter", "launch", "load_config_files", "main",
           "memory_gb", "parse_args", "parse_with_configs", "recompute_kwargs", "run_rank", "train",
           "transformer_config", "validate_args"]

if __name__ == "__main__":
    main()
