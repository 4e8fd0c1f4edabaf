"""The model arguments and weights of a `megatron-cp-pretrain` checkpoint, so that generation needs no model flags.

Both formats the trainer writes (training/checkpoint.py): megatron-core's dist_checkpointing ("torch_dist", DDP
with or without the distributed optimizer) and torch.distributed.checkpoint of Megatron-FSDP's DTensors
("fsdp_dtensor": keys "model.module.<name>", fp32 main weights, "model_args.<name>"); the checkpoint's
megatron_cp_plugin.json names its format.

A checkpoint states its own shape: the common state's `model_args` when the trainer recorded them (the
`MODEL_ARGS` names below), otherwise the global shapes of its tensors (dist_checkpointing metadata): layers,
hidden size, FFN size and vocabulary are read off them; the head counts are not (the fused QKV weight has
(h + 2 h_kv) * d rows for any split of h and d), so there the flags' head counts (given or default) are
checked against that row count. A model flag that is given (command line or --config) and disagrees with the
checkpoint is an error naming the flag.
"""
from __future__ import annotations

import json
import os

MODEL_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
              "vocab_size")
_QKV = "model.decoder.layers.self_attention.linear_qkv.weight"
_FC1 = "model.decoder.layers.mlp.linear_fc1.weight"
_EMB = "model.embedding.word_embeddings.weight"


def checkpoint_path(load: str) -> str:
    """The iteration directory `--load` points at (latest_checkpointed_iteration.txt), after the trainer's file
    checks (training/checkpoint.py check_files): every file there, and every pickle in it (.metadata, common.pt,
    the .distcp files' non-tensor values) readable by a restricted unpickler, before megatron-core or torch
    unpickles any of them."""
    from ..training.checkpoint import check_files

    tracker = os.path.join(load, "latest_checkpointed_iteration.txt")
    if not os.path.exists(tracker):
        raise ValueError(f"--load {load}: no latest_checkpointed_iteration.txt there (not a megatron-cp-pretrain "
                         "checkpoint)")
    with open(tracker) as f:
        path = os.path.join(load, f"iter_{int(f.read().strip()):07d}")
    check_files(path)
    return path


def checkpoint_format(path: str) -> str:
    """"fsdp_dtensor" or "torch_dist": what megatron_cp_plugin.json says, else what the files say (only
    dist_checkpointing writes metadata.json)."""
    info = os.path.join(path, "megatron_cp_plugin.json")
    if os.path.exists(info):
        with open(info) as f:
            return json.load(f).get("format", "torch_dist")
    return "torch_dist" if os.path.exists(os.path.join(path, "metadata.json")) else "fsdp_dtensor"


def _fsdp_keys(path: str) -> dict:
    from ..training.pickles import read_index
    return read_index(path).state_dict_metadata        # not pickle.load (FileSystemReader.read_metadata)


def _dcp_load(state: dict, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    dcp.load(state, checkpoint_id=path, no_dist=True)        # every rank reads what it needs, no collective


def model_args_of(path: str) -> dict:
    """{MODEL_ARGS name: value} recorded in or read off the checkpoint at `path`; '_qkv_rows' when the head
    counts had to stay unknown."""
    from megatron.core import dist_checkpointing

    if checkpoint_format(path) == "fsdp_dtensor":              # the trainer always records them there
        names = [k.split(".", 1)[1] for k in _fsdp_keys(path) if k.startswith("model_args.")]
        state = {"model_args": dict.fromkeys(names, 0)}
        _dcp_load(state, path)
        return {k: v for k, v in state["model_args"].items() if k in MODEL_ARGS}
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


def check_loadable(path: str, tp_size: int) -> None:
    """ValueError naming the flag when generation at `tp_size` cannot load the checkpoint at `path` (files only,
    before any process group): Megatron-FSDP's DCP weights are read whole, at TP = 1."""
    if tp_size != 1 and checkpoint_format(path) == "fsdp_dtensor":
        raise ValueError(f"--tensor-model-parallel-size {tp_size}: a Megatron-FSDP checkpoint ({path}) is loaded "
                         "for generation at TP = 1 only")


def load_weights(model, path: str, tp_size: int = 1) -> None:
    """Load the checkpoint's weights into `model` (a GPTModel built with the checkpoint's model arguments)."""
    import torch

    if checkpoint_format(path) != "fsdp_dtensor":
        from megatron.core import dist_checkpointing
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict(prefix="model.")}, path)
        model.load_state_dict(loaded["model"], strict=False)
        return
    check_loadable(path, tp_size)
    saved = _fsdp_keys(path)
    params = dict(model.named_parameters())
    missing = [n for n in params if f"model.module.{n}" not in saved]
    if missing:
        raise ValueError(f"--load: {path} has no weights for {', '.join(missing[:3])}"
                         f"{' ...' if len(missing) > 3 else ''} (not a checkpoint of this model)")
    # the fp32 main weights, read into fp32 buffers of the saved shapes, then copied in the model's dtype
    state = {"model": {f"module.{n}": torch.empty(tuple(saved[f"model.module.{n}"].size), dtype=torch.float32)
                       for n in params}}
    _dcp_load(state, path)
    with torch.no_grad():
        for n, p in params.items():
            w = state["model"][f"module.{n}"]
            if w.shape != p.shape:
                raise ValueError(f"--load: {path}: {n} has shape {tuple(w.shape)}, the model {tuple(p.shape)}")
            p.copy_(w)
