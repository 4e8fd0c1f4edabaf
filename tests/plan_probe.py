"""Measures what the memory planner predicts, on CPU processes through the GPU code path (used by
tests/test_plan.py): `python -m tests.plan_probe OUT.json <megatron-cp-pretrain flags>` trains one step and
writes rank 0's parameter count, the bytes of every tensor alive after the step (weights, gradient buffers,
optimizer state) and the bytes autograd keeps for the backward of the next micro-batch, split into the
RMSNorms' own and the rest."""
from __future__ import annotations

import gc
import json
import sys
import weakref

import torch
import torch.distributed as dist


def _storage(t):
    """(address, bytes) of t's storage; None for wrapper subclasses (DTensor: its local tensor is counted) and
    storages Megatron-FSDP has freed (resized to nothing)."""
    try:
        st = t.untyped_storage()
        return (st.data_ptr(), st.nbytes()) if st.nbytes() else None
    except (RuntimeError, NotImplementedError):
        return None


def _storage_bytes(tensors) -> int:
    return sum(dict(s for s in map(_storage, tensors) if s is not None).values())


def probe(args) -> None:
    from megatron.core import parallel_state as ps

    from megatron_cp_plugin.training.config import rope_fusion_on, validate_args
    from megatron_cp_plugin.training.cpu import install_cuda_on_cpu
    from megatron_cp_plugin.training.trainer import Trainer, micro_batches

    cp_cfg = validate_args(args, dist.get_world_size())
    install_cuda_on_cpu()
    ps.initialize_model_parallel(context_parallel_size=args.context_parallel_size)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    tr = Trainer(args, cp_cfg, device)
    tr.train_step()
    gc.collect()
    static = _storage_bytes(o for o in gc.get_objects() if isinstance(o, torch.Tensor))

    stack, refs = [], []
    for name, mod in tr.gpt.named_modules():
        mod.register_forward_pre_hook(lambda m, i, n=name: stack.append(n))
        mod.register_forward_hook(lambda m, i, o: (stack.pop(), None)[1])

    def pack(t):
        refs.append((weakref.ref(t), "norm" if stack and "layernorm" in stack[-1] else "rest"))
        return t

    params = {s[0] for s in map(_storage, tr.model.parameters()) if s is not None}
    batch = next(micro_batches(tr.train_data, args, 1, tr.dp_rank))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = tr._loss(batch)
    kept = {"norm": {}, "rest": {}}
    for ref, kind in refs:                            # what is still alive is what the backward will read
        st = _storage(ref()) if ref() is not None else None
        if st is not None and st[0] not in params:
            kept[kind][st[0]] = st[1]
    if dist.get_rank() == 0:
        with open(args.probe_out, "w") as f:
            json.dump({"n_params": tr.n_params, "static_bytes": static, "device": device.type,
                       "rope_fusion": rope_fusion_on(args, device.type == "cuda"),
                       "saved_norm_bytes": sum(kept["norm"].values()),
                       "saved_rest_bytes": sum(kept["rest"].values())}, f)
    loss.backward()
    ps.destroy_model_parallel()


if __name__ == "__main__":
    from megatron_cp_plugin.training.config import parse_args
    from megatron_cp_plugin.training.launch import launch

    a = parse_args(sys.argv[2:])
    a.probe_out = sys.argv[1]
    launch(a, probe)
