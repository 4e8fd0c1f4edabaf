"""External context-parallel attention implementations, timed in the same run as ours (the anchors users
would otherwise use). Each builder takes the full q, k, v, dO [b, S, h, d] (identical on every rank) and
returns (fwd, fwd_bwd) closures over this rank's shard, or raises Unavailable with the reason, which the
report prints instead of a number.

  torch-cp-<rotate>-<kernel>  PyTorch's native context parallel (torch.distributed.tensor.experimental.
                              context_parallel): SDPA patched into ring attention over a DeviceMesh, its K/V
                              rotation by all-gather or all-to-all, load-balanced causal sharding, and the
                              SDPA kernel cuDNN or FA2 (sdpa_kernel).
  te-p2p                      TransformerEngine's DotProductAttention with cp_comm_type="p2p" (when TE is
                              installed).
  ring-flash-attn             zhuzilin/ring-flash-attention's zigzag_ring_flash_attn_func (when installed).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


class Unavailable(RuntimeError):
    """This anchor cannot run here (missing package, unsupported shape); the message says why."""


def torch_cp(q, k, v, do, *, causal: bool, rotate: str, kernel: str):
    """PyTorch native CP. rotate: "allgather" | "alltoall"; kernel: "cudnn" | "flash"."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import set_rotate_method
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        raise Unavailable(f"torch {torch.__version__} has no native context parallel ({e})") from e
    if not q.is_cuda:
        raise Unavailable("torch native CP needs CUDA tensors (its DeviceMesh and SDPA kernels)")
    if q.shape[2] != k.shape[2]:
        raise Unavailable("torch native CP runs SDPA without GQA: K/V heads must equal Q heads")
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    set_rotate_method(rotate)
    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[kernel]
    # SDPA layout [b, h, S, d]; context_parallel shards these buffers in place (its own load balancing)
    # for as long as the context is open, and patches SDPA into its ring implementation.
    qb, kb, vb, dob = (t.transpose(1, 2).contiguous() for t in (q, k, v, do))
    stack = contextlib.ExitStack()
    stack.enter_context(context_parallel(mesh, buffers=[qb, kb, vb, dob], buffer_seq_dims=[2, 2, 2, 2]))
    stack.enter_context(sdpa_kernel([backend]))
    leaves = [t.detach().requires_grad_() for t in (qb, kb, vb)]

    def fwd():
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)

    def fwd_bwd():
        o = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
        torch.autograd.grad(o, leaves, dob)

    try:
        fwd_bwd()
    except Exception as e:  # noqa: BLE001 - an unsupported kernel/rotation is reported, not fatal
        stack.close()
        raise Unavailable(f"{type(e).__name__}: {str(e).splitlines()[0][:160]}") from e
    return fwd, fwd_bwd, stack


def te_p2p(q, k, v, do, *, causal: bool):
    try:
        import transformer_engine.pytorch as te
    except ImportError as e:
        raise Unavailable("transformer-engine is not installed (pip install 'megatron-cp-plugin[te]')") from e
    except Exception as e:  # noqa: BLE001 - a broken install (CUDA / library mismatch) is reported, not fatal
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        raise Unavailable(f"import transformer_engine failed: {msg}") from e
    if not q.is_cuda:
        raise Unavailable("TransformerEngine's CP attention needs CUDA tensors")
    from ..sharding import shard_sequence   # TE's p2p CP uses Megatron's zigzag layout, as ring does

    group = dist.group.WORLD
    h, hk, d = q.shape[2], k.shape[2], q.shape[3]
    attn = te.DotProductAttention(h, d, num_gqa_groups=hk, attn_mask_type="causal" if causal else "no_mask",
                                  qkv_format="bshd")
    attn.set_context_parallel_group(group, list(range(dist.get_world_size())), torch.cuda.Stream(),
                                    cp_comm_type="p2p")
    ql, kl, vl = (shard_sequence(t, algo="ring", group=group).requires_grad_() for t in (q, k, v))
    dol = shard_sequence(do, algo="ring", group=group).flatten(2)

    def fwd():
        with torch.no_grad():
            return attn(ql, kl, vl)

    def fwd_bwd():
        torch.autograd.grad(attn(ql, kl, vl), (ql, kl, vl), dol)

    fwd_bwd()
    return fwd, fwd_bwd, contextlib.ExitStack()


def ring_flash_attn(q, k, v, do, *, causal: bool):
    try:
        from ring_flash_attn import zigzag_ring_flash_attn_func
    except ImportError as e:
        raise Unavailable("ring-flash-attn (and flash-attn) is not installed") from e
    from ..sharding import shard_sequence

    group = dist.group.WORLD
    ql, kl, vl = (shard_sequence(t, algo="ring", group=group).requires_grad_() for t in (q, k, v))
    dol = shard_sequence(do, algo="ring", group=group)

    def fwd():
        with torch.no_grad():
            return zigzag_ring_flash_attn_func(ql, kl, vl, causal=causal, group=group)

    def fwd_bwd():
        torch.autograd.grad(zigzag_ring_flash_attn_func(ql, kl, vl, causal=causal, group=group), (ql, kl, vl), dol)

    fwd_bwd()
    return fwd, fwd_bwd, contextlib.ExitStack()


def builders(causal: bool):
    """name -> builder(q, k, v, do) for every anchor, in report order."""
    out = {f"torch-cp-{rot}-{ker}": (lambda q, k, v, do, rot=rot, ker=ker:
                                     torch_cp(q, k, v, do, causal=causal, rotate=rot, kernel=ker))
           for rot in ("allgather", "alltoall") for ker in ("cudnn", "flash")}
    out["te-p2p"] = lambda q, k, v, do: te_p2p(q, k, v, do, causal=causal)
    out["ring-flash-attn"] = lambda q, k, v, do: ring_flash_attn(q, k, v, do, causal=causal)
    return out
