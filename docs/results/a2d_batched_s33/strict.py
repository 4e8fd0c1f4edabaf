"""cuDNN causal s x s against "causal_strict" as run today (q[1:] over all keys, top-left) and padded (q[1:] plus one
dummy row: s rows again), fwd and bwd, 32 heads of 128, bf16."""
import torch
from megatron_cp_plugin.kernels import local_attn as la
from megatron_cp_plugin.bench._common import time_ms
dev, dt, h, d = "cuda", torch.bfloat16, 32, 128
for s in (16384, 8192, 32768):
    q, k, v, do = (torch.randn(1, s, h, d, device=dev, dtype=dt) for _ in range(4))
    sc = d ** -0.5
    qs = q[:, 1:]
    qp = torch.cat([q[:, 1:], torch.zeros_like(q[:, :1])], 1)
    dop = torch.cat([do[:, 1:], torch.zeros_like(do[:, :1])], 1)
    o, l = la._cudnn_fwd(q, k, v, True, sc, None)
    os_, ls = la._cudnn_fwd(qs, k, v, True, sc, None)
    op, lp = la._cudnn_fwd(qp, k, v, True, sc, None)
    print(s, "fwd pad == strict:", (op[:, :-1].float() - os_.float()).abs().max().item(), flush=True)
    g_s = la._cudnn_bwd(do[:, 1:], qs, k, v, os_, ls, True, sc, None)
    g_p = la._cudnn_bwd(dop, qp, k, v, op, lp, True, sc, None)
    print(s, "bwd dk pad vs strict:", (g_p[1].float() - g_s[1].float()).abs().max().item(), flush=True)
    r = {}
    for _ in range(3):
        r.setdefault("causal fwd", []).append(time_ms(lambda: la._cudnn_fwd(q, k, v, True, sc, None), iters=10))
        r.setdefault("strict fwd", []).append(time_ms(lambda: la._cudnn_fwd(qs, k, v, True, sc, None), iters=10))
        r.setdefault("padded fwd", []).append(time_ms(lambda: la._cudnn_fwd(qp, k, v, True, sc, None), iters=10))
        r.setdefault("causal bwd", []).append(time_ms(lambda: la._cudnn_bwd(do, q, k, v, o, l, True, sc, None), iters=10))
        r.setdefault("strict bwd", []).append(time_ms(lambda: la._cudnn_bwd(do[:, 1:], qs, k, v, os_, ls, True, sc, None), iters=10))
        r.setdefault("padded bwd", []).append(time_ms(lambda: la._cudnn_bwd(dop, qp, k, v, op, lp, True, sc, None), iters=10))
    for name, t in r.items():
        print(s, name, " ".join(f"{x:.3f}" for x in t), flush=True)
