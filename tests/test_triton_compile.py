"""Every Triton kernel compiles for Hopper (sm_90), on a machine without a GPU.

The CPU tests run the kernels in Triton's interpreter, which executes Python and never type-checks the
kernel as the compiler does: a kernel can pass them all and still not compile (a value of one dtype in the
`if` branch and another in the `else` branch did, in rope_append, on its first GPU run). Compiling ahead of
time for sm_90 needs only Triton's bundled ptxas, so CI catches that class of error. It runs in a child
process without TRITON_INTERPRET (which the other tests set, and which makes @triton.jit interpret).
"""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CASES = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import torch
from megatron_cp_plugin.kernels import flash_decode, merge, peer_merge, rope_append, surrogate

def compile_(kernel, types, constexprs):
    sig = {n: ("constexpr" if n in constexprs else types.get(n, "i32")) for n in kernel.arg_names}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
    assert triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]

failed = []
def case(name, *a):
    try:
        compile_(*a)
    except Exception as e:                      # noqa: BLE001 (reported below, one line per kernel)
        failed.append(f"{name}: {type(e).__name__}: {str(e).strip().splitlines()[-1]}")

for dt in ("bf16", "fp16", "fp32"):
    ptr = {n: f"*{dt}" for n in ("Q", "K", "V", "QO", "KC", "VC")}
    ptr.update(COS="*fp32", SIN="*fp32", SLOT="*i64")
    case(f"rope_append {dt}", rope_append._rope_append_kernel, ptr, {"D": 128})
    for d in (64, 128):
        for masks in ((False, False, False), (True, True, True)):
            t = {n: f"*{dt}" for n in ("Q", "K", "V")}
            t.update(KPOS="*i64", QPOS="*i64", KLEN="*i32", O="*fp32", L="*fp32", scale_log2="fp32")
            c = dict(NQ=1, G=4, BLOCK_M=16, BLOCK_N=64, D=d, HAS_KPOS=masks[0], HAS_QPOS=masks[1],
                     HAS_KLEN=masks[2], PREC="ieee" if dt == "fp32" else "tf32")
            case(f"flash_decode partial {dt} d={d} masks={masks}", flash_decode._partial_kernel, t, c)
        case(f"flash_decode merge {dt} d={d}", flash_decode._merge_kernel,
             {"O": "*fp32", "L": "*fp32", "OUT": f"*{dt}", "LSE": "*fp32"}, {"PARTS": 4, "D": d})
for dt, tdt in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
    for keys, i64, w in ((False, True, 32), (True, True, 128), (True, False, 32), (True, False, 16)):
        case(f"surrogate {dt} keys={keys} i64={i64} W={w}", surrogate._surrogate_kernel,
             {"DO": f"*{dt}", "DELTA": "*fp32", "OUT": f"*{dt}"},
             {"D": 128, "BLOCK_D": 128, "BLOCK_R": 16, "W": w, "NTOP": 3, "BIG": torch.finfo(tdt).max,
              "BF16": dt == "bf16", "KEYS": keys, "SHIFT": surrogate.KEY_SHIFT.get(tdt, -1), "I64": i64})
    for copy in (False, True):
        case(f"accumulate {dt} copy={copy}", merge._accumulate_kernel, {"A": "*fp32", "X": f"*{dt}"},
             {"BLOCK_R": 32, "BLOCK_D": 128, "COPY": copy})
for dt in ("bf16", "fp32"):
    for pdl in (False, True):
        case(f"peer_merge {dt} pdl={pdl}", peer_merge._peer_merge_kernel,
             {"DATA_PTRS": "*i64", "FLAG_PTRS": "*i64", "OUT": f"*{dt}", "LSE": "*fp32"},
             dict(PP=8, W=8, NPROG=64, BLOCK_R=4, D=128, COMPILED=True, LIMIT=1 << 30, PDL=pdl))
print("\n".join(failed) if failed else "all compiled")
'''


def test_triton_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", CASES], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("all compiled"), r.stdout
