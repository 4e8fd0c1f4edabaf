"""Micro-benchmark: k cuDNN causal calls of s x s against one batched call of b = k (and one call of 2s)."""
import json, sys, torch
from megatron_cp_plugin.kernels import local_attn as la

torch.manual_seed(0)
dev, dt, h, d = "cuda", torch.bfloat16, 32, 128
res = {}

def t(fn, iters=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]

for s, k in ((16384, 4), (8192, 4), (8192, 2), (4096, 4), (1024, 4)):
    q = torch.randn(1, s, h, d, device=dev, dtype=dt)
    kk = torch.randn(k, s, h, d, device=dev, dtype=dt)
    vv = torch.randn(k, s, h, d, device=dev, dtype=dt)
    do = torch.randn(1, s, h, d, device=dev, dtype=dt)
    sc = d ** -0.5
    outs = [la._cudnn_fwd(q, kk[i:i + 1], vv[i:i + 1], True, sc, None) for i in range(k)]
    qb = q.expand(k, -1, -1, -1).contiguous()
    dob = do.expand(k, -1, -1, -1).contiguous()
    ob, lb = la._cudnn_fwd(qb, kk, vv, True, sc, None)
    err = max((ob[i:i + 1].float() - outs[i][0].float()).abs().max().item() for i in range(k))
    lerr = max((lb[i:i + 1] - outs[i][1]).abs().max().item() for i in range(k))
    r = {"fwd_err": err, "lse_err": lerr}
    r["fwd_k_calls"] = t(lambda: [la._cudnn_fwd(q, kk[i:i + 1], vv[i:i + 1], True, sc, None) for i in range(k)])
    r["fwd_batched"] = t(lambda: la._cudnn_fwd(qb, kk, vv, True, sc, None))
    r["fwd_batched_with_copy"] = t(lambda: la._cudnn_fwd(q.expand(k, -1, -1, -1).contiguous(), kk, vv, True, sc, None))
    try:
        oe, le = la._cudnn_fwd(q.expand(k, -1, -1, -1), kk, vv, True, sc, None)
        r["expand_ok"] = (oe.float() - ob.float()).abs().max().item()
        r["fwd_expand"] = t(lambda: la._cudnn_fwd(q.expand(k, -1, -1, -1), kk, vv, True, sc, None))
    except Exception as e:
        r["expand_ok"] = repr(e)[:200]
    r["bwd_k_calls"] = t(lambda: [la._cudnn_bwd(do, q, kk[i:i + 1], vv[i:i + 1], outs[i][0], outs[i][1], True, sc, None)
                                  for i in range(k)])
    g1 = [la._cudnn_bwd(do, q, kk[i:i + 1], vv[i:i + 1], outs[i][0], outs[i][1], True, sc, None) for i in range(k)]
    gb = la._cudnn_bwd(dob, qb, kk, vv, ob, lb, True, sc, None)
    r["bwd_err"] = max((gb[j][i:i + 1].float() - g1[i][j].float()).abs().max().item() for i in range(k) for j in range(3))
    r["bwd_batched"] = t(lambda: la._cudnn_bwd(dob, qb, kk, vv, ob, lb, True, sc, None))
    q2 = torch.randn(1, k * s // 2, h, d, device=dev, dtype=dt) if k == 4 else None
    if q2 is not None:   # the square grid's one call of the same FLOPs: (2s)^2 / 2 = 4 s^2 / 2
        k2, v2, do2 = torch.randn_like(q2), torch.randn_like(q2), torch.randn_like(q2)
        o2, l2 = la._cudnn_fwd(q2, k2, v2, True, sc, None)
        r["fwd_one_2s"] = t(lambda: la._cudnn_fwd(q2, k2, v2, True, sc, None))
        r["bwd_one_2s"] = t(lambda: la._cudnn_bwd(do2, q2, k2, v2, o2, l2, True, sc, None))
    res[f"s{s}_k{k}"] = r
    print(s, k, json.dumps(r), flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
