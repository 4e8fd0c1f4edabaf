"""Where the surrogate kernel's time goes: variants that leave stages out (one H200), both index widths."""
import sys
import torch
import triton
import triton.language as tl
from megatron_cp_plugin.kernels import surrogate as S
from megatron_cp_plugin.kernels import _launch


@triton.jit
def _var_kernel(DO, DELTA, OUT, R, SS, H, n_tiles, s_db, s_ds, s_dh, s_dd, s_tb, s_th, s_ts,
                D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BIG: tl.constexpr,
                BF16: tl.constexpr, SHIFT: tl.constexpr, I64: tl.constexpr, STAGE: tl.constexpr):
    OUT_TY = OUT.dtype.element_ty
    pid, step = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    x_n, t_n, rows_n, ok_n = S._load_rows(DO, DELTA, pid, R, SS, H, s_db, s_ds, s_dh, s_dd, s_tb, s_th, s_ts,
                                          D, BLOCK_D, BLOCK_R, I64)
    for tile in range(pid, n_tiles, step):
        x, t, rows, ok = x_n, t_n, rows_n, ok_n
        x_n, t_n, rows_n, ok_n = S._load_rows(DO, DELTA, tile + step, R, SS, H, s_db, s_ds, s_dh, s_dd,
                                              s_tb, s_th, s_ts, D, BLOCK_D, BLOCK_R, I64)
        if STAGE == 0:
            out = x * t[:, None]
        elif STAGE == 1:
            l1 = tl.sum(tl.abs(x), 1)
            c = tl.math.div_rn(t, tl.where(l1 > 0, l1, 1.0))
            c = S._round(tl.minimum(tl.maximum(c, -BIG), BIG), OUT_TY, BF16)
            out = tl.where(x > 0, c[:, None], tl.where(x < 0, -c[:, None], 0.0))
        elif STAGE == 2:
            l1 = tl.sum(tl.abs(x), 1)
            c = tl.math.div_rn(t, tl.where(l1 > 0, l1, 1.0))
            c = S._round(tl.minimum(tl.maximum(c, -BIG), BIG), OUT_TY, BF16)
            out = tl.where(x > 0, c[:, None], tl.where(x < 0, -c[:, None], 0.0))
            sel = S._keys(x, ok, cols, SHIFT)
            j1, x1, sel = S._take_max_key(sel, SHIFT)
            rest = t - c * (l1 - tl.abs(x1))
            out, rest = S._carry(out, rest, j1, x1, cols, BIG, OUT_TY, BF16)
        else:
            out = S._rows_out(x, t, ok, cols, OUT_TY, 3, BIG, BF16, True, SHIFT)
        tl.store(OUT + rows[:, None] * D + cols[None, :], out.to(OUT_TY), mask=ok)


def run(do, delta, stage, i64, nw=2, rpp=4, pps=32):
    b, s, h, d = do.shape
    out = torch.empty_like(do)
    rows = b * s * h
    n_tiles = triton.cdiv(rows, rpp)
    programs = min(n_tiles, pps * _launch.sm_count(do.device))
    _var_kernel[(programs,)](do, delta, out, rows, s, h, n_tiles, *do.stride(), *delta.stride(), D=d, BLOCK_D=d,
                             BLOCK_R=rpp, BIG=torch.finfo(do.dtype).max, BF16=True, SHIFT=16, I64=i64, STAGE=stage,
                             num_warps=nw)
    return out


def main():
    from megatron_cp_plugin.bench._common import time_ms
    dev = torch.device("cuda")
    if sys.argv[1:] == ["ncu"]:     # one launch of each width, for ncu
        do = torch.randn(1, 16384, 32, 128, device=dev, dtype=torch.bfloat16)
        delta = (do.float() * torch.randn_like(do).float()).sum(-1).transpose(1, 2).contiguous()
        S.surrogate_out_triton(do, delta, index_bits=64)
        S.surrogate_out_triton(do, delta, index_bits=32)
        run(do, delta, 0, False)
        torch.cuda.synchronize()
        return
    for n in (524288, 131072):
        do = torch.randn(1, n // 32, 32, 128, device=dev, dtype=torch.bfloat16)
        delta = (do.float() * torch.randn_like(do).float()).sum(-1).transpose(1, 2).contiguous()
        moved = do.numel() * 4 + delta.numel() * 4
        ref = S.surrogate_out_triton(do, delta)
        assert torch.equal(run(do, delta, 3, True), ref)
        assert torch.equal(run(do, delta, 3, False), ref)
        cp = lambda: do.clone()
        ms = time_ms(cp, warmup=5, iters=50)
        print(f"rows {n} clone {ms:.4f} ms {moved / ms / 1e6:.0f} GB/s", flush=True)
        for stage in range(4):
            for i64 in (True, False):
                for nw, rpp, pps in ((2, 4, 32), (4, 16, 8), (8, 32, 4), (4, 8, 16)):
                    f = lambda: run(do, delta, stage, i64, nw, rpp, pps)
                    ms = time_ms(f, warmup=5, iters=50)
                    print(f"rows {n} stage {stage} i64 {int(i64)} nw {nw} rpp {rpp} pps {pps}: {ms:.4f} ms "
                          f"{moved / ms / 1e6:.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
