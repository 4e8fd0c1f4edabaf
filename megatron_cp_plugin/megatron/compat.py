"""Work-arounds for megatron-core behaviour (0.16.1 and later) that the trainer depends on, in one place.

- Megatron-FSDP's optimizer state (`DistributedOptimizer.sharded_state_dict` with sharding type
  "fsdp_dtensor") holds Adam's moments only for the parameters that have elements on this rank, so ranks
  hold different sets of DTensors. `preprocess_state_dict_for_uneven_dtensor`, which every fsdp_dtensor
  save and load must run, makes one collective per DTensor in the order it meets them: with different sets
  the ranks' collectives pair up wrongly and the job hangs (as soon as a small parameter, e.g. a layer norm,
  lies wholly inside one rank's shard). `even_fsdp_optimizer_state` gives every rank the same parameters in
  the same order (zero-size local shards where a rank has none, which write and read nothing), and
  `drop_fsdp_padding` removes those entries again before the state reaches the optimizer.
- Without Apex or TransformerEngine, the distributed optimizer wraps torch's Adam, and its `state_dict()`
  (which `sharded_state_dict(..., is_loading=True)` calls first) asserts that every parameter's state has a
  "step": a fresh optimizer has no state at all, so a checkpoint could only be loaded after a step.
  `init_adam_state_for_loading` gives it zero state with step 0, which the load then overwrites.
  Except the step itself: `load_state_dict` restores it from the saved param groups and then, restoring the
  "dp_reshardable" buffers, copies over it the step the loading state dict was built with (kept there as a
  non-persistent object), i.e. 0. `restore_adam_steps` puts the saved step back (TE's and Apex's Adam keep no
  per-parameter step, so Megatron-LM's usual GPU set-up does not meet this).
- The "dp_reshardable" layout saves the gaps between parameters in the flat buffers as `torch.empty`
  tensors: the files then hold whatever memory was there, and two identical runs write different bytes.
  `zero_dp_reshardable_padding` zeroes them, so that checkpoints of equal states are equal files.
- Megatron-FSDP's gradient dtype: 0.16.1 reduces and keeps the sharded main gradients in fp32 when
  `grad_reduce_in_fp32` is set; from the releases with `megatron_fsdp_main_grads_dtype` (0.19.2 here) Megatron-FSDP
  ignores `grad_reduce_in_fp32`: left unset, the gradients are reduce-scattered and kept in the model's bf16, and
  `finish_grad_sync` then makes an fp32 copy of the shard for the optimizer that lives until the next step. That
  reduced the gradients in bf16 where the trainer asks for fp32, and made the optimizer step 2 bytes a parameter of
  the shard bigger than 0.16.1's (GPT-3 13B on 2 x H200, FSDP + recompute, ran out of memory in Adam's step).
  `fsdp_grad_dtype_kwargs` asks for fp32 main gradients where the field exists, so every version runs the same.
- Fused RoPE: megatron-core calls `rope_utils.fused_apply_rotary_pos_emb` when `apply_rope_fusion` is on, a slot only
  TransformerEngine fills (None without it, and the config refuses the flag). `install_fused_rope` puts our Triton
  kernel (kernels/rope.py) there where TE did not, so that the trainer's GPU runs fuse RoPE with or without TE;
  interleaved RoPE, which the kernel does not implement, goes to megatron-core's own unfused function.
- Without TE or Apex megatron-core steps torch's Adam in its foreach form: ~10 passes over the fp32 state and
  an fp32 temporary per parameter. `use_fused_adam` switches its param groups to torch's fused kernel, which
  computes the same update in one pass and keeps no temporary. The trainer does this on GPUs for DDP and the
  distributed optimizer (plain tensors), not under Megatron-FSDP, whose optimizer steps DTensors.
- `DistributedOptimizer.load_state_dict` copies fp32 main parameters into views of leaf parameters that
  require grad; without `torch.no_grad()` autograd refuses (fp32 training: the CPU path). The trainer loads
  under no_grad.
"""
from __future__ import annotations

import torch


def _fsdp_optimizers(optimizer):
    """The DistributedOptimizers inside a (Chained)Optimizer."""
    return getattr(optimizer, "chained_optimizers", None) or [optimizer]


def even_fsdp_optimizer_state(optimizer, optim_sd: dict) -> set:
    """Pad optim_sd["state"] (fsdp_dtensor layout: {param name: {"step", "exp_avg", ...}}) in place so that
    every rank has every parameter, sorted by name; returns the names that were padded here."""
    state = optim_sd["state"]
    params = {}
    for opt in _fsdp_optimizers(optimizer):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                params[opt._param_name(p)] = p
    moment_keys = sorted({k for v in state.values() for k, x in v.items() if isinstance(x, torch.Tensor)
                          and x.dim() > 0}) or ["exp_avg", "exp_avg_sq"]
    padded = set()
    for name, p in params.items():
        if name not in state:
            # zeros_like keeps the DTensor's mesh, placements and global shape, and its (empty) local shard
            state[name] = {k: torch.zeros_like(p) for k in moment_keys}
            padded.add(name)
    optim_sd["state"] = {k: state[k] for k in sorted(state)}
    return padded


def drop_fsdp_padding(optim_sd: dict, padded: set) -> None:
    """Remove the entries even_fsdp_optimizer_state added (their parameters had no state on this rank)."""
    for name in padded:
        optim_sd["state"].pop(name, None)


def init_adam_state_for_loading(optimizer) -> None:
    """Give the distributed optimizer's torch Adam zero moments and step 0 where it has no state yet (what
    megatron-core's own init_state_fn does, plus the step its state_dict() needs)."""
    from megatron.core.optimizer import distrib_optimizer as dopt

    if dopt.HAVE_APEX_OR_TE:
        return
    for opt in _fsdp_optimizers(optimizer):
        if not isinstance(opt, dopt.DistributedOptimizer) or opt.ddp_config.use_megatron_fsdp:
            continue                                  # Megatron-FSDP initialises its own (fsdp_dtensor)
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if len(inner.state[p]) == 0:
                    inner.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p.data),
                                          exp_avg_sq=torch.zeros_like(p.data))


def restore_adam_steps(optimizer) -> None:
    """After DistributedOptimizer.load_state_dict with torch's Adam: every parameter's step := its group's saved
    step (the param groups keep the saved value under "step")."""
    from megatron.core.optimizer import distrib_optimizer as dopt

    if dopt.HAVE_APEX_OR_TE:
        return
    for opt in _fsdp_optimizers(optimizer):
        if not isinstance(opt, dopt.DistributedOptimizer) or opt.ddp_config.use_megatron_fsdp:
            continue
        for group in opt.optimizer.param_groups:
            if "step" in group:
                for p in group["params"]:
                    opt.optimizer.state[p]["step"] = torch.tensor(float(group["step"]))


def use_fused_adam(optimizer, devices=("cuda",)) -> bool:
    """Step megatron-core's torch Adam (no TE or Apex) with torch's fused kernel where every parameter of a group
    is a plain floating tensor on one of `devices`: one multi-tensor kernel instead of foreach's ~10 passes, and
    no fp32 temporary per parameter. Idempotent; after a checkpoint load it also moves the restored steps onto
    the parameters' device (the fused kernel reads them there). True where some group now runs fused."""
    from torch.distributed.tensor import DTensor

    any_fused = False
    for opt in _fsdp_optimizers(optimizer):
        inner, fused = getattr(opt, "optimizer", None), False
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) or inner.defaults.get("differentiable"):
            continue                                  # TE's or Apex's FusedAdam: fused already
        for group in inner.param_groups:
            params = group["params"]
            if not params or not all(p.device.type in devices and p.is_floating_point() and
                                     not isinstance(p, DTensor) for p in params):
                continue
            group["fused"], group["foreach"] = True, False
            for p in params:
                st = inner.state.get(p, {})
                if "step" in st:
                    st["step"] = torch.as_tensor(st["step"], dtype=torch.float32).to(p.device)
            fused = True
        if fused:
            inner.defaults.update(fused=True, foreach=False)
        any_fused |= fused
    return any_fused


def zero_dp_reshardable_padding(optim_sd) -> None:
    """Zero the padding entries (marked 'padding': True) of a dp_reshardable optimizer sharded state dict."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    if isinstance(optim_sd, dict):
        pad = optim_sd.get("padding")
        if isinstance(pad, LocalNonpersistentObject) and pad.obj is True:
            for v in optim_sd.values():
                if isinstance(v, ShardedTensor):
                    v.data.zero_()
            return
        for v in optim_sd.values():
            zero_dp_reshardable_padding(v)
    elif isinstance(optim_sd, list):
        for v in optim_sd:
            zero_dp_reshardable_padding(v)


def fsdp_grad_dtype_kwargs(config_cls, fp32: bool) -> dict:
    """DistributedDataParallelConfig keywords that make Megatron-FSDP keep (and reduce) its main gradients in fp32
    when `fp32` (grad_reduce_in_fp32): `megatron_fsdp_main_grads_dtype` where `config_cls` has it (newer
    megatron-core, whose default is the model's dtype), nothing where grad_reduce_in_fp32 already decides (0.16.1)."""
    import dataclasses
    fields = {f.name for f in dataclasses.fields(config_cls)}
    return {"megatron_fsdp_main_grads_dtype": torch.float32} if fp32 and "megatron_fsdp_main_grads_dtype" in fields \
        else {}


def install_fused_rope() -> None:
    """Fill megatron-core's fused-RoPE slot with kernels/rope.py where TransformerEngine left it empty (module
    docstring). It is read only by models whose config has apply_rope_fusion on: others are unaffected."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = _fused_rope_slot


def _fused_rope_slot(t, freqs, transpose_output_memory: bool = False, interleaved: bool = False):
    """TE's `fused_apply_rotary_pos_emb` signature, filled by kernels/rope.py (interleaved: megatron-core's own)."""
    from megatron.core.models.common.embeddings import rope_utils

    from ..kernels.rope import fused_rope

    if interleaved or transpose_output_memory:
        return rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)
    return fused_rope(t, freqs)
