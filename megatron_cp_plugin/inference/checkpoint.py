"""The model arguments of a `megatron-cp-pretrain` checkpoint, so that generation needs no model flags.

A checkpoint states its own shape: the common state's `model_args` when the trainer recorded them (the
`MODEL_ARGS` names below), otherwise the global shapes of its tensors (dist_checkpointing metadata): layers,
hidden size, FFN size and vocabulary are read off them; the head counts are not (the fused QKV weight has
(h + 2 h_kv) * d rows for any split of h and d), so there the flags' head counts (given or default) are
checked against that row count. A model flag that is given (command line or --config) and disagrees with the
checkpoint is an error naming the flag.
"""
from __future__ import annotations

import os

MODEL_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
              "vocab_size")
_QKV = "model.decoder.layers.self_attention.linear_qkv.weight"
_FC1 = "model.decoder.layers.mlp.linear_fc1.weight"
_EMB = "model.embedding.word_embeddings.weight"


def checkpoint_path(load: str) -> str:
    """The iteration directory `--load` points at (latest_checkpointed_iteration.txt)."""
    tracker = os.path.join(load, "latest_checkpointed_iteration.txt")
    if not os.path.exists(tracker):
        raise ValueError(f"--load {load}: no latest_checkpointed_iteration.txt there (not a megatron-cp-pretrain "
                         "checkpoint)")
    with open(tracker) as f:
        return os.path.join(load, f"iter_{int(f.read().strip()):07d}")


def model_args_of(path: str) -> dict:
    """{MODEL_ARGS name: value} recorded in or read off the checkpoint at `path`; '_qkv_rows' when the head
    counts had to stay unknown."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(path)
    if isinstance(common, dict) and isinstance(common.get("model_args"), dict):
        return {k: v for k, v in common["model_args"].items() if k in MODEL_ARGS}
    meta = dist_checkpointing.load_tensors_metadata(path)
    try:
        layers, qkv_rows, hidden = meta[_QKV].global_shape
        ffn = meta[_FC1].global_shape[1]
        vocab = meta[_EMB].global_shape[0]
    except (KeyError, ValueError) as e:
        raise ValueError(f"--load: {path} does not hold a GPT of megatron-cp-pretrain's layout ({e})") from None
    return {"num_layers": layers, "hidden_size": hidden, "ffn_hidden_size": ffn, "vocab_size": vocab,
            "_qkv_rows": qkv_rows}


def apply_model_args(args, ckpt: dict, given: set[str], defaults: dict) -> None:
    """Set args' model fields from the checkpoint. `given`: the fields set on the command line or in --config
    (each must agree with the checkpoint); `defaults`: values for fields neither gives."""
    for name in MODEL_ARGS:
        flag = "--" + name.replace("_", "-")
        if name in ckpt:
            if name in given and getattr(args, name) != ckpt[name]:
                raise ValueError(f"{flag} {getattr(args, name)} does not match the checkpoint's {ckpt[name]}: leave it "
                                 "out, with --load the model arguments come from the checkpoint")
            setattr(args, name, ckpt[name])
        elif name not in given:
            setattr(args, name, defaults.get(name))
    if "_qkv_rows" in ckpt:                          # heads not recorded: the flags' must fit the QKV rows
        h = args.num_attention_heads
        h_kv = args.num_query_groups or h
        d = args.hidden_size // h if h and args.hidden_size % h == 0 else None
        if d is None or (h + 2 * h_kv) * d != ckpt["_qkv_rows"]:
            raise ValueError(f"--num-attention-heads {h} / --num-query-groups {args.num_query_groups}: the "
                             f"checkpoint's QKV weight has {ckpt['_qkv_rows']} rows for hidden size "
                             f"{args.hidden_size}, these heads give {(h + 2 * h_kv) * (d or 0)}; this checkpoint "
                             "does not record its head counts, so pass the ones it was trained with")


def set_unless_given(args, given: set[str], defaults: dict) -> None:
    """Without --load: the model fields nobody gave take their defaults."""
    for name in MODEL_ARGS:
        if name not in given:
            setattr(args, name, defaults.get(name))
