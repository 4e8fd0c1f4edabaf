"""Sharding a Megatron batch in the data loader, and the loss over context-parallel ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..sharding import sequence_positions

SEQ_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def shard_batch(batch: dict, *, algo: str, cp_group) -> dict:
    """This CP rank's part of a batch in `algo`'s layout (replaces Megatron's zigzag-only
    `get_batch_on_this_cp_rank`): tokens, labels, loss_mask, position_ids [b, S] -> [b, S / P];
    attention_mask [b, 1, S, S] keeps its keys and loses the other ranks' query rows. Other keys pass."""
    size, rank = cp_group.size(), cp_group.rank()
    if size == 1:
        return dict(batch)
    out = dict(batch)
    for key, val in batch.items():
        if val is None or not torch.is_tensor(val):
            continue
        if key in SEQ_KEYS:
            dim = 1
        elif key == "attention_mask":
            dim = 2
        else:
            continue
        pos = sequence_positions(val.shape[dim], algo=algo, rank=rank, world_size=size)
        out[key] = val.index_select(dim, pos.to(val.device))
    return out


def cp_token_mean_loss(per_token_loss: torch.Tensor, loss_mask: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to backpropagate, reported loss) for the global token mean over `group` (CP, or DP x CP).

    per_token_loss, loss_mask [b, s_local]. The backpropagated loss is this rank's masked sum divided by the
    number of loss tokens on all ranks, so the gradients summed over `group` (not averaged) are exactly the
    gradients of the global token-mean loss; the reported loss is that mean, the same on every rank.
    """
    mask = loss_mask.to(per_token_loss.dtype)
    local = (per_token_loss * mask).sum()
    stats = torch.stack([local.detach().float(), mask.sum().float()])
    dist.all_reduce(stats, group=group)
    return local / stats[1], stats[0] / stats[1]
