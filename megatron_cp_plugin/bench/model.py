"""A whole GPT (or one transformer layer) per algorithm: step time, tokens/s, TFLOP/s per GPU and MFU.

    megatron-cp-bench model --nproc 2 --config configs/gpt3-760m.toml --seq-length 65536 --train-iters 8
    megatron-cp-bench layer --nproc 2 --hidden-size 4096 --num-attention-heads 32 --seq-length 131072

Runs `megatron-cp-pretrain` (mock data) once per algorithm under torchrun with --nproc processes, plus CP = 1
on one process unless --no-cp1, each writing its --result-json; every flag this command does not know is
passed to pretraining (model size, --config files, --bf16, --use-distributed-optimizer, ...). `layer` is
`model --num-layers 1`. MFU divides the model TFLOP/s per GPU (pretraining's formula, printed) by the bf16
matmul peak measured in the same run (an 8192^3 matmul on GPU 0). The CP = 1 run also gives each algorithm's
largest loss difference from it over the same iterations; without one (--no-cp1, or when it failed or did not
run) the table has no loss-difference column.

Memory: before each run starts, the memory planner (bench/plan.py, the layout the flags select, CP = the run's
ranks) predicts its per-GPU peak; with --plan-headroom GiB on top (GPUs only: CUDA context, NCCL, allocator slack)
that is checked against what GPU 0 has free (`_common.not_fitting`; GPU 0 also holds this process's context, so
it is the most loaded of the run's GPUs), times the ranks per GPU where they share one, or against the host's
available memory for CPU ranks. A run that does not fit is not started: its row says why (`not_run`) with the
planner's numbers (`plan`), one line is printed, and the others run (--force starts it anyway). Where the planner
cannot say (TP > 1, flags it cannot parse) the run starts unchecked.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys

import torch

import megatron_cp_plugin as mcp
from megatron_cp_plugin.algos import registry
from megatron_cp_plugin.bench._common import GiB, not_fitting, time_ms, write_report


def matmul_peak_tflops() -> float:
    """Median bf16 TFLOP/s of an 8192^3 matmul on GPU 0 (0 on CPU), measured in a child process: a CUDA context
    in this process would hold ~0.6 GiB of GPU 0 for as long as the runs it launches (GPT-3 13B at 64k on 2 x H200,
    session 17: allgather ran out of memory 0.4 GiB short, with this process's context on the GPU)."""
    if not torch.cuda.is_available():
        return 0.0
    code = "from megatron_cp_plugin.bench.model import _matmul_peak; print(_matmul_peak())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    try:
        return float(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        print(f"megatron-cp-bench: the matmul peak was not measured: {proc.stderr.strip()[-300:]}", flush=True)
        return 0.0


def _matmul_peak() -> float:
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = time_ms(lambda: a @ b, warmup=5, iters=20)
    return 2 * 8192 ** 3 / ms / 1e9


def _run(nproc: int, flags: list[str], out_json: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "megatron_cp_plugin.pretrain", *flags, "--mock-data", "--result-json", out_json]
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode or not os.path.exists(out_json):
        text = (proc.stdout + proc.stderr).strip()
        print("\n".join(text.splitlines()[-15:]), flush=True)
        return {"status": "failed", "error": failure_reason(text, out_json)}
    with open(out_json) as f:
        return json.load(f)


def plan_need(flags: list[str], nproc: int, headroom_gib: float) -> tuple[float, float, str, float] | None:
    """(bytes the run of megatron-cp-pretrain `flags` on `nproc` ranks needs on one GPU, or on the host for CPU
    ranks; the planner's peak of one rank; its breakdown in one line; its static bytes: weights, gradients and
    optimizer state), or None where the planner cannot say."""
    from . import launch_plan, plan
    from .. import devices
    from ..training.config import parse_args

    try:
        with contextlib.redirect_stderr(io.StringIO()):           # the run itself reports bad flags
            a = parse_args(flags)
        m = plan.model_from_args(a)
        lay = launch_plan.config_layout(a)
        gpus, capacity = devices.gpu_count(), devices.gpu_capacity_gib()
        share = -(-nproc // gpus) if gpus else 1                     # ranks on GPU 0 (more ranks than GPUs: shared)
        # at the group cap the run's own memory check gives it (the largest that fits), where it has GPUs to check
        est = (plan.fit(m, lay, nproc, capacity / share, headroom_gib) if gpus and capacity
               else plan.estimate(m, lay, nproc))
    except (SystemExit, ValueError):
        return None
    parts = " + ".join(f"{k} {getattr(est, k) / GiB:.1f}" for k in ("weights", "grads", "optimizer",
                                                                     "activations", "transient"))
    if gpus:
        need = share * (est.total + headroom_gib * GiB)
        line = (f"plan ({lay.name}, CP = {nproc}): {parts} = {est.total / GiB:.1f} GiB per rank + {headroom_gib:g} "
                f"GiB headroom" + (f", {share} ranks per GPU" if share > 1 else ""))
    else:
        need = nproc * est.total                                     # CPU ranks share the host's memory
        line = f"plan ({lay.name}, CP = {nproc}): {parts} = {est.total / GiB:.1f} GiB per rank, {nproc} ranks"
    return need, est.total, line, est.weights + est.grads + est.optimizer


def failure_reason(text: str, out_json: str) -> str:
    """One line for a run that failed: the rank's own error from its record where it wrote one, else the last
    exception line of its output (not torchrun's closing banner); a CUDA OOM as what was allocated and asked."""
    err = None
    try:
        with open(out_json) as f:
            err = json.load(f).get("error")
    except (OSError, ValueError):
        pass
    if not err:
        lines = [ln.strip() for ln in text.splitlines() if re.search(r"\b\w*(Error|Exception)\b:", ln)]
        err = lines[-1] if lines else next((ln.strip() for ln in reversed(text.splitlines())
                                            if ln.strip() and not set(ln.strip()) <= set("=-")), "no output")
    oom = re.search(r"Tried to allocate ([\d.]+ [GM]iB).*?([\d.]+ GiB) is allocated by PyTorch", err)
    if oom:
        return f"CUDA out of memory: {oom.group(2)} allocated, asked {oom.group(1)} more"
    return err


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=max(1, torch.cuda.device_count()), help="CP size (GPUs)")
    p.add_argument("--algos", nargs="+", default=list(registry.names()), choices=registry.names())
    p.add_argument("--no-cp1", action="store_true", help="skip the CP = 1 baseline (when it does not fit)")
    p.add_argument("--out", default="results/model")
    p.add_argument("--plan-headroom", type=float, default=4.0, metavar="GIB",
                   help="GiB per GPU the memory check keeps free beyond the planner's peak (default 4, the planner's)")
    p.add_argument("--force", action="store_true", help="start runs the memory planner says do not fit")
    a, flags = p.parse_known_args(argv)
    from .. import devices
    refuse = devices.too_many_ranks(a.nproc, devices.sharing())      # before any run starts
    if refuse:
        raise SystemExit(f"megatron-cp-bench: error: {refuse}")
    if "--train-iters" not in flags:
        flags += ["--train-iters", "8"]
    if a.force:                        # megatron-cp-pretrain's own check (training/memory_check.py) would refuse
        flags += ["--no-memory-check"]
    peak = matmul_peak_tflops()
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    planned, planned_static = {}, {}

    def launch(name, nproc, run_flags, out_json):
        """_run, unless the planner says the run does not fit (then a not-run record, nothing started)."""
        plan = plan_need(run_flags, nproc, a.plan_headroom if dev.type == "cuda" else 0.0)
        if plan is not None:
            planned[name] = plan[1] / GiB
            planned_static[name] = plan[3] / GiB
            why = None if a.force else not_fitting(plan[0], dev)
            if why:
                print(f"model: {name}: {why}; {plan[2]}", flush=True)
                return {"status": "not run", "not_run": why, "plan": plan[2]}
        return _run(nproc, run_flags, out_json)

    runs = {}
    if not a.no_cp1:
        runs["CP=1"] = launch("CP=1", 1, flags + ["--context-parallel-size", "1"], a.out + "_cp1.json")
    for algo in a.algos:
        runs[algo] = launch(algo, a.nproc, flags + ["--context-parallel-algo", algo, "--context-parallel-size",
                                                    str(a.nproc)], f"{a.out}_{algo}.json")
    ref = runs.get("CP=1", {}).get("losses")
    rows = []
    for name, r in runs.items():
        if r.get("status") == "not run":
            rows.append({"run": name, "plan": r["plan"], "not_run": r["not_run"]})
            continue
        if r.get("status") != "ok":
            rows.append({"run": f"{name} (failed: {str(r.get('error'))[:120]})",
                         "plan_GiB": planned.get(name, float("nan"))})
            continue
        losses = r.get("losses") or []
        tf = r.get("tflops_per_gpu") or float("nan")
        row = {"run": name, "P": r.get("world_size", 1), "seq": r.get("seq_length"),
               "step_ms": 1e3 * (r.get("step_time_median_s") or float("nan")),
               "tokens_per_s": r.get("tokens_per_s"), "TFLOPs_per_GPU": tf,
               "MFU": tf / peak if peak else float("nan"), "peak_mem_GB": r.get("peak_mem_gb"),
               "plan_GiB": planned.get(name, float("nan")),
               "final_loss": losses[-1] if losses else float("nan")}
        got = r.get("peak_mem_gb")                    # GiB (torch.cuda.max_memory_allocated / 2^30)
        if got and name in planned:                   # issue 35: the planner within 3 % of the measured peak
            row["plan_vs_peak"] = planned[name] / got - 1
        static = (r.get("mem_after_step_gib") or [None])[-1]
        if static and name in planned_static:         # between steps: what the weights, grads, optimizer hold
            row["static_GiB"], row["plan_static_GiB"] = static, planned_static[name]
        if ref and name != "CP=1":                    # only a CP = 1 run that finished gives a difference
            row["max_loss_diff_vs_cp1"] = max((abs(x - y) for x, y in zip(losses, ref)), default=float("nan"))
        rows.append(row)
    from megatron_cp_plugin.training.report import flops_per_iter
    formula = " ".join(flops_per_iter.__doc__.split())
    header = (f"model: {' '.join(flags)}; {a.nproc} x "
              f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}; step time = median over "
              f"the timed iterations; model FLOPs per iteration: {formula}; matmul peak {peak:.0f} TFLOP/s (bf16 "
              f"8192^3, measured here).")
    print(write_report(rows, a.out, header), flush=True)
    bad = [n for n, r in runs.items() if r.get("status") not in ("ok", "not run")]   # a skipped run is no failure
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
