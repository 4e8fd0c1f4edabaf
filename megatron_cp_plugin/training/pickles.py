"""The pickles in a checkpoint directory, read before anything else unpickles them (training/checkpoint.py's
check_files, in the launching process and in each rank). torch's DCP reader unpickles the `.metadata` index with
pickle.load and every non-tensor value in the `.distcp` files with torch.load(weights_only=False); megatron-core
< 0.19 reads `common.pt` with torch.load. Here each is read with a restricted unpickler that builds only the types
our checkpoints hold, so a crafted file is refused, naming the global it would call, before any of it runs
(docs/training.md, "Checkpoint files and trust")."""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib
import io
import itertools
import os
import pathlib
import pickle
import re

import numpy as np
import torch


# What our checks let torch.load(weights_only=True) build beyond what it builds by default (tensors, dicts, lists,
# tuples, numbers, strings, OrderedDict). common.pt: nothing; it holds the schedule, iteration, model_args and the
# optimizer's param_groups and step (checked on torch_dist saves: DDP, the distributed optimizer, TP = 2). The
# pickled values in the .distcp files add NumPy's generator state (rng_state: an MT19937 key array).
COMMON_GLOBALS: list = []


def _numpy_rng_globals() -> list:
    try:
        from numpy._core.multiarray import _reconstruct       # numpy >= 2
    except ImportError:
        from numpy.core.multiarray import _reconstruct
    allowed = [np.ndarray, np.dtype, _reconstruct, type(np.dtype(np.uint32))]   # numpy.dtypes.UInt32DType
    if torch.torch_version.TorchVersion(torch.__version__) >= (2, 6):
        # a state pickled by numpy 1 names numpy.core.multiarray, numpy 2's by numpy._core.multiarray (torch >= 2.6
        # takes a (global, name) pair)
        allowed += [(_reconstruct, "numpy.core.multiarray._reconstruct"),
                    (_reconstruct, "numpy._core.multiarray._reconstruct")]
    return allowed


def _allowing(allowed: list):
    """torch.load(weights_only=True) may build `allowed` too, inside the with block. Where megatron-core has been
    imported it has registered its own list for good (megatron/core/safe_globals.py), which then applies as well:
    the same that megatron-core's own loads accept. The launching process, where --load is checked first, never
    imports megatron-core."""
    if hasattr(torch.serialization, "safe_globals"):         # torch >= 2.5
        return torch.serialization.safe_globals(allowed)
    torch.serialization.add_safe_globals(allowed)            # torch 2.4: no context manager
    return contextlib.nullcontext()


def check_torch_save(f, what: str, allowed: list, holds: str) -> None:
    """torch.load(f, weights_only=True) building only `allowed` beyond the defaults: nothing in f's pickle runs
    that is not a tensor rebuild or one of them. ValueError naming `what` when f is damaged or would build any
    other global (what a crafted file does to run code)."""
    try:
        with _allowing(allowed):
            torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a damaged file and a refused global both end here
        text = str(e)
        refused = re.search(r"GLOBAL (\S+) was not an allowed global|but got <class '([^']+)'>", text)
        if refused:
            raise ValueError(f"checkpoint file {what}: refused: its pickle would call "
                             f"{refused.group(1) or refused.group(2)}, and ours hold only {holds} (nothing was "
                             "called; load only checkpoints you trust)") from None
        why = text.split("WeightsUnpickler error:", 1)[-1].strip().splitlines()
        raise ValueError(f"checkpoint file {what}: unreadable ({type(e).__name__}: {(why or [''])[0][:80]}): "
                         "truncated or not a torch.save file") from None


# A torch.distributed.checkpoint index (.metadata) is a pickle of DCP's metadata dataclasses and enums (Metadata,
# TensorStorageMetadata, ChunkStorageMetadata, MetadataIndex, the _StorageInfo of each item; dist_checkpointing
# adds its SavePlans / WriteItems), torch.Size, dtypes, layouts (pickled as torch.serialization._get_layout(name))
# and memory formats, and the checkpoint's path (StorageMeta.checkpoint_id, a PosixPath with Megatron-FSDP).
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                "torch.distributed.checkpoint.filesystem")


def _index_global(module: str, name: str):
    """The object a .metadata pickle may name as `module.name`, or None."""
    if module in _DCP_MODULES:
        obj = getattr(importlib.import_module(module), name, None)
        if isinstance(obj, type) and obj.__module__ == module and (dataclasses.is_dataclass(obj)
                                                                   or issubclass(obj, enum.Enum)):
            return obj
    elif module == "torch":
        obj = getattr(torch, name, None)
        if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            return obj
    elif module == "torch.serialization" and name == "_get_layout":
        return torch.serialization._get_layout
    elif module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
        return getattr(pathlib, name)
    return None


class _Refused(Exception):
    pass


class _IndexUnpickler(pickle.Unpickler):
    """pickle's Unpickler that finds only _index_global's objects: a pickle naming anything else (a function
    to call, a class to build) stops at that name, before it is called."""

    def find_class(self, module, name):
        obj = _index_global(module, name)
        if obj is None:
            raise _Refused(f"{module}.{name}")
        return obj


def read_index(path: str):
    """The torch.distributed.checkpoint Metadata of the checkpoint directory `path`, read by _IndexUnpickler rather
    than by torch's FileSystemReader.read_metadata (pickle.load: any code the file names would run); ValueError
    naming the file when it is missing, damaged or names anything else."""
    from torch.distributed.checkpoint.metadata import Metadata

    index = os.path.join(path, ".metadata")
    if not os.path.isfile(index):
        raise ValueError(f"checkpoint {path}: its index file .metadata is missing (an incomplete checkpoint)")
    try:
        with open(index, "rb") as f:
            metadata = _IndexUnpickler(f).load()
    except _Refused as e:
        raise ValueError(f"checkpoint file {index}: refused: its pickle would call {e}, which is not one of "
                         "torch.distributed.checkpoint's index types (nothing was called; load only checkpoints you "
                         "trust)") from None
    except Exception as e:  # noqa: BLE001 - pickle/EOF/OS errors of a damaged file all mean the same here
        metadata = e
    if not isinstance(metadata, Metadata):
        why = f"{type(metadata).__name__}: {str(metadata)[:80]}" if isinstance(metadata, Exception) else \
            f"it holds a {type(metadata).__name__}"
        raise ValueError(f"checkpoint file {index}: unreadable ({why}): truncated or not a "
                         "torch.distributed.checkpoint index")
    return metadata


def check_pickled_values(path: str, metadata) -> None:
    """Every non-tensor value in the .distcp files (DCP stores each as a torch.save blob: megatron-core's
    ShardedObjects such as rng_state and, from 0.19 on, its common state; under Megatron-FSDP the schedule,
    iteration and generators too), read as torch's DCP reader will, which torch.load()s them with
    weights_only=False: here with weights_only=True and our allow-list."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    items = sorted((info.relative_path, info.offset, info.length, idx.fqn, getattr(info, "transform_descriptors", None))
                   for idx, info in metadata.storage_data.items()
                   if isinstance(metadata.state_dict_metadata.get(idx.fqn), BytesStorageMetadata))
    allowed = _numpy_rng_globals()
    for name, group in itertools.groupby(items, key=lambda item: item[0]):
        file = os.path.join(path, name)
        with open(file, "rb") as f:
            for _, offset, length, fqn, transforms in group:
                if transforms:                   # compressed or otherwise encoded: not what our trainer writes
                    raise ValueError(f"checkpoint file {file}: refused: its value {fqn!r} is stored with transforms "
                                     f"{list(transforms)}, which this check does not read")
                f.seek(offset)
                check_torch_save(io.BytesIO(f.read(length)), f"{file} (its value {fqn!r})", allowed,
                                  "tensors, numbers, strings, containers and NumPy generator states")
