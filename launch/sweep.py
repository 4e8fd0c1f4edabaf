#!/usr/bin/env python3
"""Scaling sweep: one training run per (sequence length, algorithm), then a summary table.

    python launch/sweep.py --config configs/gpt3-2.7b.toml --seq 16384 32768 65536 \\
        --algos ring attention2d-no attention2d-o --nodes 16 --gpus-per-node 4 \\
        --partition gpu --account myproj --venv $PWD/.venv --result-dir results/gpt3-2.7b_16x4
    python launch/sweep.py --local --config configs/tiny.toml --seq 256 512 --nproc-per-node 4 --result-dir r
    python launch/sweep.py --summarize results/gpt3-2.7b_16x4      # rebuild summary.md from what is there

With SLURM, each run is one `sbatch launch/scaling.sbatch` (launch/run.sh: one torchrun per node, CP over all
ranks); the jobs are submitted together and SLURM queues them. The sweep then polls squeue until they have
left it and reads each job's final state and exit code from scontrol (sacct once scontrol has forgotten the
job). With --local, each run is launch/local.sh, one after another. Written to --result-dir:
  <run>.json   the run's --result-json (settings, per-iteration losses and step times, medians, status)
  <run>.out    the run's log (the job's stdout and stderr)
  sweep.json   one record per run: seq, algo, shape, job id, SLURM state, exit code, file names
  summary.md   one table row per run, with the speed-up over ring at the same sequence length
Exit status: 0 when every run completed with exit code 0.
"""
from __future__ import annotations

import argparse
import getpass
import json
import os
import re
import shlex
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALGOS = ("ring", "burst", "attention2d-no", "attention2d-o")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--config", nargs="+", default=["configs/tiny.toml"], help="config files (later ones override earlier)")
    a("--seq", nargs="+", type=int, help="sequence lengths, one run each per algorithm")
    a("--algos", nargs="+", default=list(ALGOS), help="--context-parallel-algo values (default: the four)")
    a("--nodes", type=int, default=1)
    a("--nproc-per-node", type=int, default=None, help="ranks per node (default: --gpus-per-node, else 1)")
    a("--gpus-per-node", type=int, default=0, help="GPUs to request per node (0: a CPU run)")
    a("--partition"), a("--account"), a("--qos")
    a("--time", default="01:00:00", help="time limit per job")
    a("--sbatch-arg", action="append", default=[], help="one more sbatch flag (repeatable), e.g. --sbatch-arg=--mem=0")
    a("--script", default="launch/scaling.sbatch", help="the sbatch script of each run")
    env = p.add_mutually_exclusive_group()
    env.add_argument("--venv", help="virtualenv to run in (on a filesystem every node sees)")
    env.add_argument("--container", help="container image for srun --container-image (pyxis/enroot)")
    a("--python", default=None, help="interpreter when there is no --venv (default: this one)")
    a("--extra-args", default="", help="more megatron-cp-pretrain flags for every run (quoted as one string)")
    a("--recompute-from-seq", type=int, default=None, metavar="N",
      help="add configs/recompute-full.toml to runs with --seq >= N (what the paper did for 13B)")
    a("--result-dir", default="results/sweep")
    a("--local", action="store_true", help="no SLURM: launch/local.sh, one run after another")
    a("--dry-run", action="store_true", help="print the commands, run nothing")
    a("--no-wait", action="store_true", help="submit and leave; --summarize later")
    a("--poll", type=float, default=10.0, help="seconds between squeue polls")
    a("--timeout", type=float, default=None, help="give up (scancel what is left) after this many seconds")
    a("--summarize", metavar="DIR", help="only rebuild DIR/summary.md from DIR/sweep.json and the JSON results")
    args = p.parse_args(argv)
    if not args.summarize and not args.seq:
        p.error("--seq is required (or --summarize DIR)")
    if args.local and args.nodes != 1:
        p.error("--local runs on this machine: --nodes must be 1")
    args.nproc_per_node = args.nproc_per_node or args.gpus_per_node or 1
    return args


def plan(args) -> list[dict]:
    """One record per (seq, algo): its name, environment for launch/run.sh or local.sh, and files."""
    rdir = os.path.abspath(args.result_dir)
    stem = os.path.splitext(os.path.basename(args.config[0]))[0]
    runs = []
    # ranks start in the checkout: a config this shell sees goes by its absolute path, others by REPO's
    base = [os.path.abspath(c) if os.path.exists(c) else c for c in args.config]
    for seq in args.seq:
        configs = list(base)
        if args.recompute_from_seq is not None and seq >= args.recompute_from_seq:
            configs.append("configs/recompute-full.toml")
        for algo in args.algos:
            name = f"{stem}_{algo}_s{seq}_{args.nodes}x{args.nproc_per_node}"
            env = {"REPO": REPO, "CONFIG": " ".join(configs), "ALGO": algo, "SEQ": str(seq),
                   "NPROC_PER_NODE": str(args.nproc_per_node), "EXTRA_ARGS": args.extra_args,
                   "RESULT_DIR": rdir, "RUN_NAME": name}
            if args.venv:
                env["VENV"] = os.path.abspath(args.venv)
            elif args.container:
                env["CONTAINER"] = args.container
            else:
                env["PYTHON"] = args.python or sys.executable
            runs.append({"name": name, "seq": seq, "algo": algo, "nodes": args.nodes,
                         "nproc_per_node": args.nproc_per_node, "configs": configs, "env": env,
                         "result": f"{name}.json", "log": f"{name}.out", "job_id": None, "state": None,
                         "exit_code": None})
    return runs


def sbatch_cmd(args, run) -> list[str]:
    cmd = ["sbatch", "--parsable", f"--job-name=cp-{run['algo']}-s{run['seq']}", f"--nodes={args.nodes}",
           "--ntasks-per-node=1", f"--time={args.time}", f"--chdir={REPO}",
           f"--output={os.path.join(run['env']['RESULT_DIR'], run['log'])}", "--export=ALL"]
    if args.gpus_per_node:
        cmd.append(f"--gpus-per-node={args.gpus_per_node}")
    for flag in ("partition", "account", "qos"):
        if getattr(args, flag):
            cmd.append(f"--{flag}={getattr(args, flag)}")
    return cmd + list(args.sbatch_arg) + [os.path.join(REPO, args.script)]


def _sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def job_final_state(job_id: str) -> tuple[str, str]:
    """(state, exit code "rc:signal") of a job that has left the queue: scontrol while slurmctld still holds
    it (MinJobAge), else the accounting database."""
    r = _sh(["scontrol", "show", "job", "-o", job_id])
    if r.returncode == 0:
        state, code = re.search(r"JobState=(\S+)", r.stdout), re.search(r"ExitCode=(\d+:\d+)", r.stdout)
        if state and code:
            return state.group(1), code.group(1)
    r = _sh(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"])
    if r.returncode == 0 and r.stdout.strip():
        state, code = r.stdout.strip().splitlines()[0].split("|")[:2]
        return state.split()[0], code
    return "UNKNOWN", "?"


def wait_for_jobs(runs, poll: float, timeout: float | None) -> None:
    """Poll squeue until every job has left the queue (sbatch --wait polls slowly and holds one job each)."""
    waiting = {r["job_id"]: r for r in runs if r["job_id"]}
    t0, user = time.time(), getpass.getuser()
    while waiting:
        q = _sh(["squeue", "-h", "-u", user, "-o", "%i %T"])
        if q.returncode != 0:                        # slurmctld busy or restarting: ask again
            time.sleep(poll)
            continue
        queued = dict(line.split()[:2] for line in q.stdout.splitlines() if line.strip())
        for jid in list(waiting):
            if queued.get(jid) in (None, *TERMINAL):
                run = waiting.pop(jid)
                run["state"], run["exit_code"] = job_final_state(jid)
                print(f"sweep: job {jid} {run['name']}: {run['state']} exit {run['exit_code']}", flush=True)
        if waiting and timeout is not None and time.time() - t0 > timeout:
            _sh(["scancel", *waiting])
            for jid, run in waiting.items():
                run["state"], run["exit_code"] = "SWEEP_TIMEOUT", "?"
            print(f"sweep: gave up after {timeout:.0f} s, cancelled {' '.join(waiting)}", file=sys.stderr)
            return
        if waiting:
            time.sleep(poll)


def run_local(run) -> None:
    env = {**os.environ, **run["env"]}
    env.pop("SLURM_JOB_ID", None)                    # local.sh names no job, even inside an allocation
    with open(os.path.join(run["env"]["RESULT_DIR"], run["log"]), "w") as log:
        rc = subprocess.call(["bash", os.path.join(REPO, "launch", "local.sh")], env=env, stdout=log,
                             stderr=subprocess.STDOUT, cwd=REPO)
    run["state"], run["exit_code"] = ("COMPLETED" if rc == 0 else "FAILED"), f"{rc}:0"
    print(f"sweep: {run['name']}: {run['state']} exit {run['exit_code']}", flush=True)


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def summarize(rdir: str) -> str:
    """summary.md from sweep.json and the runs' result JSONs; returns its text."""
    with open(os.path.join(rdir, "sweep.json")) as f:
        runs = json.load(f)["runs"]
    results = {}
    for run in runs:
        path = os.path.join(rdir, run["result"])
        if os.path.exists(path):
            with open(path) as f:
                results[run["name"]] = json.load(f)
    ring = {run["seq"]: results[run["name"]].get("step_time_median_s") for run in runs
            if run["algo"] == "ring" and run["name"] in results}
    first = next(iter(results.values()), {})
    lines = [f"# Scaling sweep: {' '.join(runs[0]['configs']) if runs else ''}", ""]
    if first.get("num_layers"):
        lines += [f"Model: {first['num_layers']} layers, hidden {first['hidden_size']}, "
                  f"{first['num_attention_heads']} heads (head dim {first['head_dim']}), "
                  f"{first.get('n_params', 0) / 1e6:.1f}M parameters; micro-batch "
                  f"{first['micro_batch_size']}, global batch {first['global_batch_size']}, "
                  f"{'bf16' if first.get('bf16') else 'fp32'} on {first.get('device')}. Step time: median over "
                  f"iterations 2..N. Speed-up: ring's median step time / this run's, same sequence length.", ""]
    lines += ["| seq | algo | nodes x ranks | CP | job | state | exit | step s (median) | tokens/s | TFLOP/s/GPU "
              "| peak mem GB | final loss | speed-up vs ring |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in sorted(runs, key=lambda r: (r["seq"], ALGOS.index(r["algo"]) if r["algo"] in ALGOS else 99)):
        r = results.get(run["name"], {})
        step, base = r.get("step_time_median_s"), ring.get(run["seq"])
        state = run.get("state") or "-"
        if r.get("status") == "failed" and state == "COMPLETED":
            state = "COMPLETED (run failed)"
        cells = [run["seq"], run["algo"], f"{run['nodes']} x {run['nproc_per_node']}", r.get("cp_size", "-"),
                 run.get("job_id") or "-", state, run.get("exit_code") or "-", _fmt(step, ".4g"),
                 _fmt(r.get("tokens_per_s"), ".0f"), _fmt(r.get("tflops_per_gpu"), ".3g"),
                 _fmt(r.get("peak_mem_gb"), ".2f"), _fmt(r.get("final_loss"), ".6f"),
                 _fmt(base / step if base and step else None, ".2f")]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(rdir, "summary.md"), "w") as f:
        f.write(text)
    return text


def _save(rdir, args, runs) -> None:
    with open(os.path.join(rdir, "sweep.json"), "w") as f:
        json.dump({"argv": sys.argv[1:], "local": args.local, "runs": runs}, f, indent=1)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize), end="")
        return 0
    runs, rdir = plan(args), os.path.abspath(args.result_dir)
    if args.dry_run:
        for run in runs:
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in run["env"].items())
            cmd = ["bash", "launch/local.sh"] if args.local else sbatch_cmd(args, run)
            print(f"{env} {shlex.join(cmd)}")
        return 0
    os.makedirs(rdir, exist_ok=True)
    if args.local:
        for run in runs:
            run_local(run)
            _save(rdir, args, runs)
    else:
        for run in runs:
            r = _sh(sbatch_cmd(args, run), env={**os.environ, **run["env"]})
            if r.returncode != 0:
                run["state"], run["exit_code"] = "SUBMIT_FAILED", "?"
                print(f"sweep: sbatch failed for {run['name']}: {r.stderr.strip()}", file=sys.stderr)
                continue
            run["job_id"] = r.stdout.strip().split(";")[0]   # --parsable: "id" or "id;cluster"
            print(f"sweep: submitted {run['name']} as job {run['job_id']}", flush=True)
        _save(rdir, args, runs)
        if args.no_wait:
            return 0
        wait_for_jobs(runs, args.poll, args.timeout)
        _save(rdir, args, runs)
    print(summarize(rdir), end="")
    ok = all(run["state"] == "COMPLETED" and run["exit_code"] == "0:0" for run in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
