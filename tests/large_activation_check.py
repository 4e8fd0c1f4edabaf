"""Issue 15, item 1, on one GPU: where does the gradient error on large fp16 / bf16 activations come from?

    python3 tests/large_activation_check.py            (one GPU; the algorithms run on a 1-rank NCCL group)

Input: b = 1, s = 512, h = 2, d = 128, causal, q, k ~ N(0, 1), v ~ 1500 + N(0, 1), dO = 0.5 (fp16: D =
rowsum(dO * O) = 96000 > 65504). Prints the relative (Frobenius) error against fp64 of o, dq, dk, dv for:
  torch SDPA <backend>     torch's public scaled_dot_product_attention: what a single-GPU user gets
  flash_attn               the flash-attn package's flash_attn_func, when importable
  block <backend> O        our block_fwd / block_bwd from the real O (the library call ring makes)
  block <backend> surr     the same backward from surrogate_out(dO, D) (what burst and Attention2D hand it)
  block <backend> exactD   the same backward from a surrogate of D formed from an fp32 forward's O: what an
                           exact D would give (not available in training: the fused kernels emit 16-bit O)
  <algo> P=1               context_parallel_attention on a 1-rank group, default backend
Checks (exit 1 on failure): block O within 2x of torch SDPA on the same backend; surr within 5e-2 of O (fp32
summation order of D only); each algorithm within 2x of torch SDPA on the default backend.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

import megatron_cp_plugin as mcp
from megatron_cp_plugin.bench._common import init_distributed
from megatron_cp_plugin.kernels.local_attn import (
    _flash_attn_module,
    attention_delta,
    block_bwd,
    block_fwd,
    select_backend,
    surrogate_out,
)
from megatron_cp_plugin.kernels.reference import attention_reference

SDPA = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def _rel_l2(x, ref):
    return (torch.linalg.vector_norm(x.double() - ref) / torch.linalg.vector_norm(ref)).item()


def _inputs(dtype, dev):
    g = torch.Generator(device=dev).manual_seed(15)
    q, k, v = (torch.randn(1, 512, 2, 128, device=dev, generator=g) for _ in range(3))
    return q.to(dtype), k.to(dtype), (v + 1500).to(dtype), torch.full_like(q, 0.5).to(dtype)


def _sdpa(q, k, v, do, backend):
    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPA[backend]]):
        o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        grads = torch.autograd.grad(o, (qt, kt, vt), do.transpose(1, 2))
    return tuple(t.transpose(1, 2) for t in (o,) + grads)


def _flash_attn(q, k, v, do):
    from flash_attn import flash_attn_func  # noqa: PLC0415 (optional)

    qt, kt, vt = (t.detach().requires_grad_() for t in (q, k, v))
    o = flash_attn_func(qt, kt, vt, causal=True)
    return (o,) + torch.autograd.grad(o, (qt, kt, vt), do)


def main():
    rank, world, dev = init_distributed()
    assert world == 1 and dev.type == "cuda", "needs a CUDA GPU, run as one process (no torchrun)"
    failures = []
    for dtype in (torch.float16, torch.bfloat16):
        q, k, v, do = _inputs(dtype, dev)
        qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
        o_ref, _ = attention_reference(qr, kr, vr, mask="causal")
        ref = (o_ref.detach(),) + torch.autograd.grad(o_ref, (qr, kr, vr), do.double())
        rows = {}
        for name in SDPA:
            try:
                rows[f"torch SDPA {name}"] = _sdpa(q, k, v, do, name)
            except RuntimeError as e:                   # a backend this build or dtype does not have
                print(f"{dtype} torch SDPA {name}: not run ({str(e).splitlines()[0][:100]})")
        if _flash_attn_module() is not None:
            rows["flash_attn"] = _flash_attn(q, k, v, do)
        o32, _ = block_fwd(q.float(), k.float(), v.float(), mask="causal", backend="math")
        exact_d = attention_delta(do, o32)
        for be in ("cudnn", "flash", "flash_attn"):
            try:
                select_backend(q.device, dtype, 128, be)
            except ValueError as e:
                print(f"{dtype} block {be}: not run ({e})")
                continue
            o, lse = block_fwd(q, k, v, mask="causal", backend=be)
            rows[f"block {be} O"] = (o,) + block_bwd(do, q, k, v, o, lse, mask="causal", backend=be)
            rows[f"block {be} surr"] = (o,) + block_bwd(do, q, k, v, surrogate_out(do, attention_delta(do, o)), lse,
                                                        mask="causal", backend=be)
            rows[f"block {be} exactD"] = (o,) + block_bwd(do, q, k, v, surrogate_out(do, exact_d), lse,
                                                          mask="causal", backend=be)
        for algo in mcp.ALGORITHMS:
            ql, kl, vl = (mcp.shard_sequence(t, algo=algo).requires_grad_() for t in (q, k, v))
            o = mcp.context_parallel_attention(ql, kl, vl, algo=algo)
            rows[f"{algo} P=1"] = (o,) + torch.autograd.grad(o, (ql, kl, vl), mcp.shard_sequence(do, algo=algo))
        err = {n: [_rel_l2(x, r) for x, r in zip(t, ref)] for n, t in rows.items()}
        print(f"\n{dtype}: relative error against fp64 (Frobenius)\n{'':24s}{'o':>10s}{'dq':>10s}{'dk':>10s}{'dv':>10s}")
        for n, e in err.items():
            print(f"{n:24s}" + "".join(f"{x:10.2e}" for x in e))
        # Checks.
        for be in ("cudnn", "flash"):
            if f"block {be} O" in err and f"torch SDPA {be}" in err:
                if not all(a <= 2 * b + 1e-3 for a, b in zip(err[f"block {be} O"], err[f"torch SDPA {be}"])):
                    failures.append(f"{dtype} block {be}: worse than torch SDPA {be}")
            if f"block {be} surr" in rows:
                same = [_rel_l2(a, b.double()) for a, b in zip(rows[f"block {be} surr"][1:], rows[f"block {be} O"][1:])]
                if not all(s <= 5e-2 for s in same):
                    failures.append(f"{dtype} block {be}: surrogate O gives other gradients than O: {same}")
        default = select_backend(q.device, dtype, 128)
        base = err.get(f"torch SDPA {default}") or err.get(f"block {default} O")
        for algo in mcp.ALGORITHMS if base else ():
            if not all(a <= 2 * b + 1e-3 for a, b in zip(err[f"{algo} P=1"], base)):
                failures.append(f"{dtype} {algo} P=1: more than twice the error of single-GPU {default}")
    print("\n" + ("\n".join(failures) if failures else "large_activation_check: all ok"))
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
