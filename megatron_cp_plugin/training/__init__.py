"""megatron-cp-pretrain's trainer, one module per concern:

config      flags, --config files, TransformerConfig, start-up checks (shared with other CLIs)
trainer     model + Megatron DDP / Megatron-FSDP + Megatron optimizer + schedule + data; one step
checkpoint  save / resume (dist_checkpointing for DDP, torch DCP for Megatron-FSDP), RNG state
loop        the training loop of one rank
report      FLOPs, memory, log lines, --result-json
launch      torchrun or spawned ranks, failure handling, --compare-cp1, main()
cpu         Megatron's GPU code on a CPU (gloo) for the tests
"""
from .config import (SHARDING_STRATEGIES, add_run_args, build_parser, load_config_files, parse_args,
                     parse_with_configs, recompute_kwargs, sharding_strategy, transformer_config, validate_args)
from .launch import launch, main, run_rank
from .report import flops_per_iter, memory_gb

__all__ = ["SHARDING_STRATEGIES", "add_run_args", "build_parser", "flops_per_iter", "launch", "load_config_files",
           "main", "memory_gb", "parse_args", "parse_with_configs", "recompute_kwargs", "run_rank",
           "sharding_strategy", "transformer_config", "validate_args"]
