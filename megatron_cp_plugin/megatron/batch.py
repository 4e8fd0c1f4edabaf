"""Sharding a Megatron batch in the data loader, packed documents, and the loss over context-parallel ranks.

Packed batches (Megatron's THD format): one row of documents laid end to end, with `cu_seqlens` (int32
[n_docs + 1]) their cumulative boundaries. `pack_documents` turns an ordinary batch with end-of-document tokens
into one (what `--reset-attention-mask --reset-position-ids` mean); `shard_batch` gives every CP rank its part
of each document in the algorithm's layout; `packed_seq_params` is what the GPTModel then takes.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..algos import registry
from ..sharding import document_offsets, sequence_positions

SEQ_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def packed_unit(algo: str, cp_size: int) -> int:
    """The multiple every document length must be in a packed Megatron batch: 2 x CP when CP > 1 (Megatron's THD
    RoPE splits each document's local tokens into two halves, whatever the layout), a multiple of every layout's
    unit too (so the same for every --context-parallel-algo value `algo`), else 1."""
    if algo not in registry.flag_choices() + registry.names(baselines=True):
        raise ValueError(f"algo must be one of {registry.flag_choices()}, got {algo!r}")
    return math.lcm(2 * cp_size, registry.any_divisor(cp_size)) if cp_size > 1 else 1


def batch_offsets(batch: dict, unit: int = 1) -> tuple[int, ...] | None:
    """The document boundaries of a packed batch as host ints (cu_seqlens_padded when present: the tokens are
    laid out by it), checked against `unit`; None for an unpacked batch. Accepts Megatron's [1, n] too."""
    cu = batch.get("cu_seqlens_padded")
    if cu is None:
        cu = batch.get("cu_seqlens")
    if cu is None:
        return None
    if isinstance(cu, torch.Tensor) and cu.dim() == 2 and cu.shape[0] == 1:
        cu = cu[0]
    return document_offsets(cu, unit=unit, why=" (2 x CP: Megatron's THD layout)" if unit > 1 else "")


def shard_batch(batch: dict, *, algo: str, cp_group) -> dict:
    """This CP rank's part of a batch in `algo`'s layout (replaces Megatron's zigzag-only
    `get_batch_on_this_cp_rank`): tokens, labels, loss_mask, position_ids [b, S] -> [b, S / P];
    attention_mask [b, 1, S, S] keeps its keys and loses the other ranks' query rows. Other keys pass.

    A packed batch (`cu_seqlens`, and `cu_seqlens_padded` when the loader padded documents; batch 1) is sharded
    document by document (every length a multiple of `packed_unit`); its packed keys pass unchanged, and
    `packed_seq_params` is added for the model. ValueError naming cu_seqlens otherwise, on every rank."""
    registry.get(algo)                                          # ValueError for an unknown algo, at any CP size
    size, rank = cp_group.size(), cp_group.rank()
    offs = batch_offsets(batch, packed_unit(algo, size))
    out = dict(batch)
    if offs is not None:
        cu = batch.get("cu_seqlens_padded")
        out["packed_seq_params"] = packed_seq_params(batch["cu_seqlens"] if cu is None else cu, offsets=offs)
    if size == 1:
        return out
    for key, val in batch.items():
        if val is None or not torch.is_tensor(val):
            continue
        if key in SEQ_KEYS:
            dim = 1
        elif key == "attention_mask":
            dim = 2
        else:
            continue
        if offs is not None and val.shape[0] != 1:
            raise ValueError(f"cu_seqlens: a packed batch has one row, got {key} {tuple(val.shape)}")
        pos = sequence_positions(val.shape[dim], algo=algo, rank=rank, world_size=size,
                                 cu_seqlens=offs)
        out[key] = val.index_select(dim, pos.to(val.device))
    return out


def packed_seq_params(cu_seqlens, *, max_seqlen: int | None = None, offsets: tuple[int, ...] | None = None):
    """megatron.core's PackedSeqParams (THD) for the whole packed sequence's cu_seqlens (int32 [n_docs + 1] on
    the model's device; the same on every CP rank). The host offsets ride along (`_cp_offsets`), so that
    CPCoreAttention never reads the boundaries back from the GPU."""
    from megatron.core.packed_seq_params import PackedSeqParams

    if offsets is None:
        offsets = document_offsets(cu_seqlens[0] if cu_seqlens.dim() == 2 else cu_seqlens)
    cu = torch.as_tensor(cu_seqlens, dtype=torch.int32).flatten()
    longest = max(b - a for a, b in zip(offsets, offsets[1:])) if max_seqlen is None else int(max_seqlen)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                             max_seqlen_kv=longest)
    params._cp_offsets = tuple(offsets)
    return params


def pack_documents(batch: dict, *, eod: int, unit: int, keep_length: bool = True) -> dict:
    """Megatron's --reset-attention-mask --reset-position-ids as a packed batch: every end-of-document token
    `eod` in `tokens` ends a document (it belongs to the one it ends), and so does every row's end.

    batch: tokens, labels, loss_mask, position_ids [b, S] (position_ids may be missing). Every document is padded
    at its end to a multiple of `unit` (`packed_unit(algo, cp)`): pad tokens and labels are `eod`, their loss
    mask 0. keep_length: each row stays S tokens (S a multiple of `unit`): the padding pushes the end of the
    row's last documents out of this sample (those tokens are not trained on here); else rows grow.
    Returns tokens, labels, loss_mask, position_ids [1, b * S'] (positions restart at 0 in every document),
    cu_seqlens int32 [n_docs + 1], max_seqlen (int) and dropped (tokens pushed out); other keys are dropped.
    """
    tokens = batch["tokens"]
    b, s = tokens.shape
    if keep_length and s % unit:
        raise ValueError(f"tokens: row length {s} must be a multiple of the document unit {unit} to keep it")
    cols = {k: [] for k in ("tokens", "labels", "loss_mask", "position_ids")}
    lengths, dropped = [], 0
    for row in range(b):
        ends = (torch.nonzero(tokens[row] == eod).flatten() + 1).tolist()
        bounds = [0] + [e for e in ends if e < s] + [s]
        used = 0
        for a, e in zip(bounds, bounds[1:]):
            n = e - a
            padded = -(-n // unit) * unit
            if keep_length and used + padded > s:        # the pads of earlier documents push this one out:
                n = padded = s - used                    # s and used are multiples of unit, so this is too
            if padded == 0:
                dropped += e - a
                continue
            dropped += (e - a) - n
            pad = padded - n
            cols["tokens"].append(torch.cat([tokens[row, a:a + n], tokens.new_full((pad,), eod)]))
            cols["labels"].append(torch.cat([batch["labels"][row, a:a + n], tokens.new_full((pad,), eod)]))
            mask = batch["loss_mask"][row, a:a + n]
            cols["loss_mask"].append(torch.cat([mask, mask.new_zeros(pad)]))
            cols["position_ids"].append(torch.arange(padded, device=tokens.device))
            lengths.append(padded)
            used += padded
    out = {k: torch.cat(v)[None] for k, v in cols.items()}
    out["position_ids"] = out["position_ids"].to(batch.get("position_ids", out["position_ids"]).dtype)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    out.update(cu_seqlens=cu.to(tokens.device), max_seqlen=max(lengths), dropped=dropped)
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
