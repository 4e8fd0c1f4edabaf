"""Saving and resuming a run: model, optimizer (Adam moments and fp32 main parameters), LR schedule,
iteration and random-number generators, so that a resumed run repeats the uninterrupted one.

Layout: `<save>/iter_<7 digits>/` per checkpoint, `<save>/latest_checkpointed_iteration.txt` naming the last
one, and `iter_*/megatron_cp_plugin.json` saying how it was written (checked before loading). Two formats, as
Megatron-LM writes them:
- DDP (with or without the distributed optimizer): megatron-core's dist_checkpointing ("torch_dist").
  The distributed optimizer's state is saved as "dp_reshardable" (each rank's flat buffer shards, no
  communication); the format megatron-core picks when given no metadata, "fully_sharded_model_space",
  describes shards by `ShardedTensor.flattened_range`, which 0.16.1's dist_checkpointing no longer accepts.
- Megatron-FSDP: torch.distributed.checkpoint of DTensors ("fsdp_dtensor"), the only format its optimizer
  state supports.
Loading is strict: every model tensor must be in the checkpoint and nothing else, and the optimizer's state
is built with `is_loading=True` so that it is restored, not re-initialised.

Pickles: the checkpoint's `.metadata` index, its `common.pt` and the non-tensor values inside the `.distcp` files
are pickles, and torch's DCP reader unpickles the index and those values without restriction (pickle.load,
torch.load(weights_only=False)). check_files reads each of them first with a restricted unpickler and refuses
any that names a type outside what our checkpoints hold, so a crafted file is refused before anything unpickles
it (docs/training.md, "Checkpoint files and trust").
"""
from __future__ import annotations

import json
import os
import pickle
import random

import numpy as np
import torch
import torch.distributed as dist

from .config import sharding_strategy
from .pickles import COMMON_GLOBALS, check_pickled_values, check_torch_save, read_index

TRACKER = "latest_checkpointed_iteration.txt"
INFO = "megatron_cp_plugin.json"
MODEL_PREFIX = "model."        # dist_checkpointing keys "model.<name>" (what megatron-cp-generate loads)


def layout_of(args) -> dict:
    """What a checkpoint must match to be loaded into a run with these flags."""
    fsdp = sharding_strategy(args)
    return {"format": "fsdp_dtensor" if fsdp else "torch_dist",
            "distributed_optimizer": bool(args.use_distributed_optimizer or fsdp), "fsdp": fsdp}


def _describe(layout: dict) -> str:
    if layout.get("fsdp"):
        return f"--use-megatron-fsdp --data-parallel-sharding-strategy {layout['fsdp']}"
    return "--use-distributed-optimizer" if layout.get("distributed_optimizer") else "Megatron's DDP optimizer"


def model_args(trainer) -> dict:
    """The model's shape, recorded so that megatron-cp-generate --load needs no model flags."""
    a = trainer.args
    return {"num_layers": a.num_layers, "hidden_size": a.hidden_size, "num_attention_heads": a.num_attention_heads,
            "num_query_groups": a.num_query_groups, "ffn_hidden_size": a.ffn_hidden_size or 4 * a.hidden_size,
            "vocab_size": trainer.vocab_rows}            # the embedding's rows (padded)


def rng_state(gpu: bool) -> dict:
    """Every generator a step may draw from: Python's, NumPy's, torch's CPU one and, on GPUs, CUDA's and
    Megatron's CUDA RNG tracker (its tensor-parallel streams)."""
    state = {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if gpu:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
        state["cuda"] = torch.cuda.get_rng_state()
        state["tracker"] = get_cuda_rng_tracker().get_states()
    return state


def set_rng_state(state: dict, gpu: bool) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if gpu:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
        torch.cuda.set_rng_state(state["cuda"])
        get_cuda_rng_tracker().set_states(state["tracker"])


def _metadata(trainer) -> dict:
    """The sharded_state_dict metadata Megatron-LM passes for torch_dist checkpoints."""
    md = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True, "dp_cp_group": trainer.dp_cp_group}
    if trainer.distributed_optimizer:
        md["distrib_optim_sharding_type"] = "dp_reshardable"
    return md


def _torch_dist_state(trainer, loading: bool) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    md = _metadata(trainer)
    model = trainer.gpt.sharded_state_dict(prefix=MODEL_PREFIX, metadata=md)
    # The generators are the same on every data-parallel x CP rank (same seed, same draws), so one copy per
    # tensor-parallel rank is saved, as Megatron-LM does; every rank of that TP rank reads it back.
    rng = ShardedObject("rng_state", rng_state(trainer.gpu), (trainer.tp_size,), (trainer.tp_rank,),
                        replica_id=trainer.dp_cp_group.rank())
    optimizer = trainer.optimizer.sharded_state_dict(model, is_loading=loading, metadata=md)
    if not loading:
        from ..megatron.compat import zero_dp_reshardable_padding
        zero_dp_reshardable_padding(optimizer)
    return {"model": model, "optimizer": optimizer,
            "scheduler": trainer.scheduler.state_dict(), "iteration": trainer.iteration, "rng_state": rng,
            "args_seq_length": trainer.args.seq_length, "model_args": model_args(trainer)}


def _fsdp_state(trainer, loading: bool) -> tuple[dict, set]:
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )

    from ..megatron.compat import even_fsdp_optimizer_state

    # MegatronFSDP's own state dict ("module.<name>"): DTensors of the fp32 main weights' shards
    sd = {"model": trainer.model.module.state_dict()}
    md = {"distrib_optim_sharding_type": "fsdp_dtensor", "dp_cp_group": trainer.dp_cp_group}
    sd["optimizer"] = trainer.optimizer.sharded_state_dict(sd, is_loading=loading, metadata=md)
    padded = even_fsdp_optimizer_state(trainer.optimizer, sd["optimizer"])
    sd.update(scheduler=trainer.scheduler.state_dict(), iteration=trainer.iteration,
              rng_state={f"tp{trainer.tp_rank}": rng_state(trainer.gpu)}, args_seq_length=trainer.args.seq_length,
              model_args=model_args(trainer))
    preprocess_state_dict_for_uneven_dtensor(sd)       # shard offsets of unevenly split DTensors
    return sd, padded


def save_checkpoint(trainer) -> str:
    """Write iteration `trainer.iteration`'s checkpoint under --save; returns its directory."""
    from megatron.core import dist_checkpointing

    args = trainer.args
    path = os.path.join(args.save, f"iter_{trainer.iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    if trainer.fsdp:
        import torch.distributed.checkpoint as dcp
        sd, _ = _fsdp_state(trainer, loading=False)
        dcp.save(sd, checkpoint_id=path)
    else:
        md = {k: v for k, v in _metadata(trainer).items() if k != "dp_cp_group"}
        dist_checkpointing.save(_torch_dist_state(trainer, loading=False), path, content_metadata=md)
    dist.barrier()
    if dist.get_rank() == 0:
        _write_atomic(os.path.join(path, INFO), json.dumps({**layout_of(trainer.args), "iteration": trainer.iteration}))
        _write_atomic(os.path.join(args.save, TRACKER), str(trainer.iteration))   # last: names a complete save
    return path


def _write_atomic(path: str, text: str) -> None:
    """Write `path` so that a kill at any moment leaves either its old or its new content, never a truncated
    file (open(path, "w") empties it first): a temporary file beside it, flushed to disk, then renamed."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def checkpoint_dir(load: str) -> str:
    """The directory --load's tracker file names; ValueError (no collective yet) when there is none."""
    tracker = os.path.join(load, TRACKER)
    if not os.path.exists(tracker):
        raise ValueError(f"--load {load}: no {TRACKER} there")
    with open(tracker, "rb") as f:
        text = f.read(64).decode("utf-8", "replace").strip()
    if not text.isdigit():
        raise ValueError(f"--load {load}: {tracker} must hold an iteration number, it holds {text[:20]!r}")
    it = int(text)
    path = os.path.join(load, f"iter_{it:07d}")
    if not os.path.isdir(path):
        raise ValueError(f"--load {load}: {TRACKER} names iteration {it}, but {path} does not exist")
    return path


def check_save_dir(args) -> None:
    """ValueError (files only, before any collective) when --save names a directory that already holds a
    checkpoint that this run would overwrite: neither resumed (--load of the same directory) nor --overwrite."""
    save = getattr(args, "save", None)
    if not save or getattr(args, "overwrite", False):
        return
    tracker = os.path.join(save, TRACKER)
    if not os.path.exists(tracker):
        return
    if args.load and os.path.realpath(args.load) == os.path.realpath(save):
        return                                          # resuming from it: its iterations continue there
    with open(tracker) as f:
        it = f.read().strip()
    hint = f"--load {args.load} is another directory" if args.load else "no --load was given"
    raise ValueError(f"--save {save} already holds a checkpoint (iteration {it}) and {hint}: add --load {save} to "
                     f"resume from it, or --overwrite to replace it")


def check_resumable(args) -> str:
    """The checkpoint directory --load names, after checking (files only, before any collective) that this
    run's flags can load it; ValueError naming the flags otherwise."""
    path = checkpoint_dir(args.load)
    now = layout_of(args)
    info_path = os.path.join(path, INFO)
    if os.path.exists(info_path):
        saved = _read_json(info_path)
    else:                                              # written before the info file existed: DDP, torch_dist
        saved = {"format": "torch_dist", "distributed_optimizer": now["distributed_optimizer"], "fsdp": None}
    if {k: saved.get(k) for k in now} != now:
        raise ValueError(f"--load {args.load}: the checkpoint was written with {_describe(saved)}; this run uses "
                         f"{_describe(now)} (resume with the same flags)")
    check_files(path)
    return path


def _read_json(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"checkpoint file {path}: not valid JSON ({e}): truncated or overwritten") from None
    if not isinstance(value, dict):
        raise ValueError(f"checkpoint file {path}: not a JSON object")
    return value


def check_files(path: str) -> None:
    """Files only, before any collective: every file a checkpoint directory's index names is there, readable and
    long enough, and every pickle in it (the .metadata index, common.pt, the non-tensor values in the .distcp files)
    builds only the types our checkpoints hold; ValueError naming the file and what is wrong (a truncated copy, a
    garbage file, a pickle that would call something else) otherwise."""
    if os.path.exists(os.path.join(path, "metadata.json")):
        _read_json(os.path.join(path, "metadata.json"))          # dist_checkpointing's format description
    metadata = read_index(path)
    need: dict[str, int] = {}
    for info in metadata.storage_data.values():   # the bytes each data file must hold
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise ValueError(f"checkpoint file {file}: missing (the index .metadata names it)")
        have = os.path.getsize(file)
        if have < size:
            raise ValueError(f"checkpoint file {file}: truncated: {have} bytes, the index .metadata needs {size}")
    check_pickled_values(path, metadata)
    common = os.path.join(path, "common.pt")
    if os.path.exists(common):                  # megatron-core < 0.19 (and its legacy layout): the common state
        with open(common, "rb") as f:
            check_torch_save(f, common, COMMON_GLOBALS, "tensors, numbers, strings and containers")


def _read(load, path: str):
    """load(), with a damaged data file (right size, wrong bytes: check_files cannot see it) reported in one line
    naming the checkpoint rather than as a deep traceback."""
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        return load()
    except CheckpointException as e:              # DCP wraps each rank's read failure
        failures = list(getattr(e, "failures", {}).values())
        why = failures[0] if failures else e
        if isinstance(why, tuple):                  # (exception, stack summary)
            why = why[0]
        if not isinstance(why, BaseException):
            why = e
        first = str(why).strip().splitlines()[0][:120] if str(why).strip() else ""
        raise ValueError(f"checkpoint {path}: a .distcp data file is damaged ({type(why).__name__}: {first})") \
            from None
    except (EOFError, OSError, pickle.UnpicklingError, UnicodeDecodeError) as e:
        first = str(e).strip().splitlines()[0][:120] if str(e).strip() else ""
        raise ValueError(f"checkpoint {path}: a file is damaged ({type(e).__name__}: {first})") from None


def load_checkpoint(trainer) -> None:
    """Restore --load's latest checkpoint into trainer (model, optimizer, schedule, iteration, generators)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    path = check_resumable(trainer.args)
    if trainer.fsdp:
        import torch.distributed.checkpoint as dcp

        from ..megatron.compat import drop_fsdp_padding
        loaded, padded = _fsdp_state(trainer, loading=True)
        _read(lambda: dcp.load(loaded, checkpoint_id=path), path)   # strict: every requested key must be there
        drop_fsdp_padding(loaded["optimizer"], padded)
        # Keys are "module.<GPT name>" with or without Float16Module (its state_dict drops its own prefix, so
        # MegatronFSDP's load_state_dict would not find them): load into the GPT by its own names, strictly,
        # then copy the fp32 main weights into the model's (bf16) compute weights.
        trainer.gpt.load_state_dict({k.removeprefix("module."): v for k, v in loaded["model"].items()}, strict=True)
        trainer.model.module.install_optimized_model_weights()
        rng = loaded["rng_state"][f"tp{trainer.tp_rank}"]
    else:
        from ..megatron.compat import init_adam_state_for_loading
        init_adam_state_for_loading(trainer.optimizer)
        state = _torch_dist_state(trainer, loading=True)
        loaded = _read(lambda: dist_checkpointing.load(state, path, strict=StrictHandling.RAISE_ALL), path)
        model = {k[len(MODEL_PREFIX):]: v for k, v in loaded["model"].items()}
        trainer.gpt.load_state_dict(model, strict=True)
        rng = loaded["rng_state"]
    from ..megatron.compat import restore_adam_steps
    with torch.no_grad():                              # see megatron/compat.py
        trainer.optimizer.load_state_dict(loaded["optimizer"])
    restore_adam_steps(trainer.optimizer)
    if getattr(trainer, "fused_adam", False):          # the load restored the saved groups' flags and CPU steps
        from ..megatron.compat import use_fused_adam
        use_fused_adam(trainer.optimizer)
    trainer.scheduler.load_state_dict(loaded["scheduler"])
    trainer.iteration = int(loaded["iteration"])
    set_rng_state(rng, trainer.gpu)
