"""Which attention backward is bit-identical from run to run on this GPU (under torch.use_deterministic_algorithms).

    python3 tests/determinism_probe.py        # one line per backend and mask: deterministic | differs | raises

Three backwards of one block (bf16, b = 1, S = 8192, 16 heads of 128, GQA 16/4 too) on the same inputs, compared
bit for bit, with torch's deterministic switch off and on. kernels/local_attn.py's NONDETERMINISTIC_BWD lists
the backends found to differ with it on; tests/test_local_attn.py checks that the automatic choice then avoids
them and that what it chooses is bit-identical.
"""
from __future__ import annotations

import torch

from megatron_cp_plugin.kernels import local_attn as la


def probe(backend, det, h_kv, mask, packed):
    g = torch.Generator(device="cuda").manual_seed(0)
    s, h, d = 8192, 16, 128
    q, do = (torch.randn(1, s, h, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, s, h_kv, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, 3000, s], dtype=torch.int32, device="cuda") if packed else None
    kw = dict(mask=mask, backend=backend, cu_seqlens_q=cu, cu_seqlens_k=cu) if packed else dict(mask=mask, backend=backend)
    torch.use_deterministic_algorithms(det)
    try:
        o, lse = la.block_fwd(q, k, v, **kw)
        outs = [la.block_bwd(do, q, k, v, o, lse, **kw) for _ in range(3)]
        same = all(torch.equal(a, b) for r in outs[1:] for a, b in zip(outs[0], r))
        return "deterministic" if same else "differs"
    except Exception as e:  # noqa: BLE001 - reported
        return f"raises {type(e).__name__}: {str(e).splitlines()[0][:100]}"
    finally:
        torch.use_deterministic_algorithms(False)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, "cuDNN", torch.backends.cudnn.version())
    for backend in ("cudnn", "flash", "flash_attn", "math"):
        for packed in (False, True):
            if la._unsupported(backend, torch.device("cuda"), torch.bfloat16, 128, packed):
                continue
            for h_kv in (16, 4):
                for mask in ("causal", "none"):
                    res = [probe(backend, det, h_kv, mask, packed) for det in (False, True)]
                    print(f"{backend:10s} {'packed' if packed else 'dense '} h_kv {h_kv:2d} {mask:6s}: "
                          f"switch off: {res[0]}; on: {res[1]}", flush=True)
