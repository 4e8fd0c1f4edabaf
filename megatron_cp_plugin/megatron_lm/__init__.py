"""Megatron-LM tooling, above the runtime (it may import megatron_cp_plugin.training, nothing below imports it):
the patcher and its command line (patching.py, cli.py: `megatron-cp-megatron-lm patch | check | revert |
parity`), the parity harness (parity.py), the config -> pretrain_gpt.py flag translator (flags.py) and the
byte-level corpus writer (preprocess.py: `megatron-cp-preprocess`). What the patched Megatron-LM calls at run
time is megatron_cp_plugin.megatron.lm."""
