"""Reading two checkpoints of megatron-cp-pretrain into flat {key: value} dicts and comparing them exactly
(tests/test_checkpoint.py and scripts/gpu_trainer_check.sh): both formats, dist_checkpointing's torch_dist
and Megatron-FSDP's, are torch.distributed.checkpoint directories underneath."""
from __future__ import annotations

import numpy as np
import torch


def flat(tree, prefix: str = "") -> dict:
    """{dotted key: leaf} of nested dicts / lists."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}{key}.").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, sub in enumerate(tree) for k, v in flat(sub, f"{prefix}{i}.").items()}
    return {prefix[:-1]: tree}


def read_checkpoint(ckpt_dir, scratch) -> dict:
    """Every tensor and object the checkpoint directory holds (converted through a file in `scratch`)."""
    from pathlib import Path

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt_dir = Path(ckpt_dir)
    out = Path(scratch) / f"{ckpt_dir.parent.name}_{ckpt_dir.name}.pt"
    dcp_to_torch_save(str(ckpt_dir), str(out))
    return flat(torch.load(out, weights_only=False))


def same(a, b) -> bool:
    """Bit-equal tensors (same dtype and shape), arrays, or equal objects (NaN equals NaN)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):                                        # NumPy's generator state
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    return a == b
