"""Why `megatron-cp-bench surrogate` read 0.244-0.254 ms at 524288 rows where the thirtieth session's interleaved
A/B read 0.199 with the same launch: the bench, then the A/B's loop, then the bench again, clocks logged."""
import statistics, subprocess, torch
from megatron_cp_plugin.bench._common import time_ms
from megatron_cp_plugin.bench import surrogate as bench
from megatron_cp_plugin.kernels import surrogate as sur

def clocks(tag):
    q = "clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active"
    print(tag, subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                              text=True).stdout.strip(), flush=True)

clocks("start")
bench.main(["--rows", "524288", "--select", "keys", "--iters", "30", "--out", "/tmp/sur1"])
clocks("after bench 1")
dev = torch.device("cuda")
do = torch.randn(1, 524288 // 32, 32, 128, device=dev, dtype=torch.bfloat16)
delta = (do.float() * torch.randn_like(do).float()).sum(-1).transpose(1, 2).contiguous()
for label, kw in (("default", {}), ("explicit as ab4", dict(slice_cols=64, num_warps=4, rows_per_program=16,
                                                            programs_per_sm=32, select="keys", index_bits=32))):
    ts = [time_ms(lambda: sur.surrogate_out_triton(do, delta, **kw), warmup=3, iters=30) for _ in range(5)]
    print(f"A/B loop {label}: median {statistics.median(ts):.4f} ms, rounds {' '.join(f'{t:.4f}' for t in ts)}", flush=True)
ref = sur.surrogate_out_reference
for _ in range(2):
    ts_ref = time_ms(lambda: ref(do, delta), warmup=2, iters=5)
    t_after_ref = time_ms(lambda: sur.surrogate_out_triton(do, delta), warmup=5, iters=30)
    print(f"kernel right after the reference ({ts_ref:.3f} ms): {t_after_ref:.4f} ms", flush=True)
    t_warm = [time_ms(lambda: sur.surrogate_out_triton(do, delta), warmup=5, iters=30) for _ in range(3)]
    print(f"then again: {' '.join(f'{t:.4f}' for t in t_warm)}", flush=True)
clocks("after loops")
bench.main(["--rows", "524288", "--select", "keys", "--iters", "30", "--out", "/tmp/sur2"])
clocks("end")
