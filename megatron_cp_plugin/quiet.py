"""Third-party fallback warnings, filtered in one place so that our own output comes first.

Importing megatron-core on a machine without TransformerEngine or Apex prints about ten warnings per process
(and megatron-cp-pretrain --nproc 2 printed 43 lines before its first iteration): each says that a fused
kernel falls back to a PyTorch one, which is expected and changes nothing we compute. `install()` runs when
`megatron_cp_plugin` is imported and ignores exactly the messages below (by their text, nothing else), in
this process and, through PYTHONWARNINGS, in the processes our commands start (torchrun workers, --nproc
children). `MEGATRON_CP_VERBOSE=1` in the environment, or `--verbose` on our commands, keeps them.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import warnings

FALLBACK_MESSAGES = (
    "Transformer Engine and Apex are not installed",       # megatron.core.optimizer, fsdp mixed precision
    "Apex is not installed",                               # megatron.core.models.backends, gpt_layer_specs
    "full scope is deprecated",                            # megatron.core.transformer config (CUDA graphs)
    "absl.logging is not installed",                       # megatron.core.hyper_comm_grid (core 0.17 on)
)
"""Warning texts (prefixes) that only announce a fallback or a deprecation of Megatron's, never a fault."""

LOG_MESSAGES = ("Unable to save MockGPTDataset indexes", "GPTModel IS DEPRECATED")
"""Megatron log records of the same kind (mock data has no index cache to save)."""

_ENV = "MEGATRON_CP_VERBOSE"
_LOGGERS = ("megatron.core.datasets.gpt_dataset", "megatron.core.models.gpt.gpt_model")
"""The loggers that emit LOG_MESSAGES (logging filters apply to the logger a record is created on)."""


class _DropFallbacks(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(msg.startswith(m) for m in LOG_MESSAGES)


_FILTER = _DropFallbacks()


def verbose() -> bool:
    """MEGATRON_CP_VERBOSE set, or `--verbose` on the command line: read at import, before any parser runs,
    because megatron-core warns while it is imported (the commands' parsers accept the flag too)."""
    if "--verbose" in sys.argv[1:]:
        os.environ[_ENV] = "1"                                      # and for the processes we start
    return os.environ.get(_ENV, "") not in ("", "0")


def install() -> None:
    """Ignore the fallback warnings here and in child processes, unless MEGATRON_CP_VERBOSE is set."""
    if verbose():
        return
    for m in FALLBACK_MESSAGES:
        warnings.filterwarnings("ignore", message=re.escape(m))
    for name in _LOGGERS:
        logging.getLogger(name).addFilter(_FILTER)
    ours = ",".join(f"ignore:{m}" for m in FALLBACK_MESSAGES)   # PYTHONWARNINGS: message prefix match
    have = os.environ.get("PYTHONWARNINGS", "")
    if ours not in have:
        os.environ["PYTHONWARNINGS"] = f"{have},{ours}" if have else ours


def set_verbose() -> None:
    """`--verbose`: show the fallback warnings from now on, here and in the processes we start."""
    os.environ[_ENV] = "1"
    warnings.filters[:] = [f for f in warnings.filters
                           if not (f[0] == "ignore" and f[1] is not None
                                   and any(f[1].pattern == re.escape(m) for m in FALLBACK_MESSAGES))]
    for name in _LOGGERS:
        logging.getLogger(name).removeFilter(_FILTER)
    ours = ",".join(f"ignore:{m}" for m in FALLBACK_MESSAGES)
    os.environ["PYTHONWARNINGS"] = os.environ.get("PYTHONWARNINGS", "").replace(ours, "").strip(",")
