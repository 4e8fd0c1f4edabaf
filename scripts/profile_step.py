"""Where one training step's time goes: torch.profiler around one iteration of megatron-cp-pretrain, on every rank.

    PROFILE_OUT=dir torchrun --nproc-per-node 2 scripts/profile_step.py --config configs/gpt3-2.7b.toml \
        --seq-length 65536 --context-parallel-algo ulysses --train-iters 3 --mock-data

Takes megatron-cp-pretrain's flags (run it under torchrun: the ranks import this file). Profiles iteration
PROFILE_ITER (default 2, i.e. the third: after the warm-up steps) and writes dir/profile_step_r<rank>.txt: the ops
and kernels by self CUDA time, then by CPU time; PROFILE_TRACE=1 adds rank 0's Chrome trace. A collective's
kernel time includes its wait for the slowest rank: compare the ranks' tables (docs/results/
profile_2.7b_64k_ulysses_s17.md).
"""
from __future__ import annotations

import os
import sys

import torch

from megatron_cp_plugin.training import trainer as _trainer
from megatron_cp_plugin.training.launch import main

_STEP = _trainer.Trainer.train_step


def _profiled_step(self):
    if self.iteration != int(os.environ.get("PROFILE_ITER", "2")):
        return _STEP(self)
    from torch.profiler import ProfilerActivity, profile, record_function

    out = os.environ.get("PROFILE_OUT", ".")
    os.makedirs(out, exist_ok=True)
    rank = torch.distributed.get_rank()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        with record_function("train_step"):
            loss = _STEP(self)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    table = prof.key_averages()
    key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    with open(os.path.join(out, f"profile_step_r{rank}.txt"), "w") as f:
        f.write(table.table(sort_by=key, row_limit=70, max_name_column_width=90) + "\n\n")
        f.write(table.table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=90))
    if rank == 0 and os.environ.get("PROFILE_TRACE") == "1":
        prof.export_chrome_trace(os.path.join(out, "profile_step_trace_r0.json"))
    return loss


_trainer.Trainer.train_step = _profiled_step

if __name__ == "__main__":
    main(sys.argv[1:])
