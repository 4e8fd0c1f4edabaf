import sys, collections, re, subprocess
import triton, torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megatron_cp_plugin.kernels import surrogate

NV = ".venv/lib/python3.11/site-packages/triton/backends/nvidia/bin"
ONES = ("s_dd", "s_ts")
DIV16 = ("DO", "DELTA", "OUT", "R", "S", "SS", "H", "s_db", "s_ds", "s_dh", "s_tb", "s_th")


def compile_(kernel, c, nw=2):
    c = dict(c, **{n: 1 for n in ONES if n in kernel.arg_names})
    types = {"DO": "*bf16", "DELTA": "*fp32", "OUT": "*bf16"}
    sig = {n: ("constexpr" if n in c else types.get(n, "i32")) for n in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n in DIV16}
    src = ASTSource(fn=kernel, signature=sig, constexprs=c, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=nw))


def loop_stats(ck, tag):
    open("/tmp/k.cubin", "wb").write(ck.asm["cubin"])
    sass = subprocess.run([f"{NV}/cuobjdump", "-sass", "/tmp/k.cubin"], capture_output=True, text=True).stdout
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4})\*/\s+([^;]*);", sass)]
    back = [(a, t) for a, t in ins if "BRA" in t and int(t.split("0x")[-1], 16) < a]
    lo, hi = (int(back[-1][1].split("0x")[-1], 16), back[-1][0]) if back else (0, ins[-1][0])
    body = [t for a, t in ins if lo <= a <= hi]
    ops = collections.Counter(re.sub(r"^@!?U?P[0-9T]+\s+", "", t).split()[0].split(".")[0] for t in body)
    layouts = sorted(set(re.findall(r"#blocked\d* = [^\n]*", ck.asm["ttgir"])))
    print(f"{tag}: {len(ins)} instructions, loop {len(body)}; regs {ck.n_regs if hasattr(ck, 'n_regs') else '?'}")
    print("   ", sorted(ops.items(), key=lambda kv: -kv[1])[:24])
    for l in layouts:
        print("   ", l)
    return sass


def sur(nw=2, rpp=4, i64=False, w=128, **kw):
    c = {"D": 128, "BLOCK_D": 128, "BLOCK_R": rpp, "BIG": torch.finfo(torch.bfloat16).max, "BF16": True,
         "SHIFT": 16, "I64": i64, "NTOP": 3, "KEYS": True, "W": w}
    c.update(kw)
    return compile_(surrogate._surrogate_kernel, c, nw)


if __name__ == "__main__":
    for nw, rpp, w in ((2, 4, 128), (2, 16, 32), (4, 32, 32), (2, 32, 16), (4, 16, 64), (1, 8, 32), (2, 8, 64)):
        for i64 in (False,):
            loop_stats(sur(nw, rpp, i64, w), f"nw {nw} rpp {rpp} w {w} i64 {i64}")
