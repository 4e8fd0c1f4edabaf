"""Parity harness: Megatron-LM's own pretrain_gpt.py with our patch, every algorithm against CP = 1.

    megatron-cp-megatron-lm parity MEGATRON_LM_DIR [--cp 2 4] [--algos ...] [--pp-run ALGO] [--fsdp-run ALGO]
    scripts/megatron_lm_check.sh MEGATRON_LM_DIR ...          (the same)

It copies the checkout (the user's stays untouched), applies the patch that fits its release, writes a
`.bin/.idx` corpus with `megatron-cp-preprocess` from the checkout's own Markdown (real text: Megatron's mock
documents are 1, 2, 3, ... and predictable without attention), then runs pretrain_gpt.py at CP = 1 (plain
Megatron-LM: its own core attention, no plugin flag) and at each CP size for each algorithm, on NCCL with one
GPU per rank (runs are packed onto the GPUs present, several at once). It prints each run's per-iteration
loss next to CP = 1 and exits 1 when any differs by more than --tol.

Tolerance: fp32 (the default) 1e-5. The same model, data and optimizer in fp32 differ only by the order of
floating-point sums (attention's online softmax over other chunks, the CP / DP gradient all-reduce); measured
differences are ~1e-6 on a loss of ~5 over 10 Adam steps, and the loss is printed to 7 digits (1e-6), so 1e-5
leaves room for both while a wrong mask, layout or RoPE position moves it by 1e-2 or more (a model whose
attention sees the wrong tokens learns a different function from the first step). bf16: 2e-2.
Megatron-LM's training loop needs CUDA (initialize.py asserts it), so the harness needs GPUs; without them it
says so and exits 3 (the pytest wrapper skips then).
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..algos import registry
from .patching import NO_TE_FLAGS, apply_patch, copy_checkout, have_te, patch_for, release_of

LOSS_RE = re.compile(r"iteration\s+(\d+)/\s*\d+\s*\|.*?lm loss:\s*([0-9.eE+-]+)")
TOL = {"fp32": 1e-5, "bf16": 2e-2}


@dataclass
class Run:
    """One pretrain_gpt.py job of the harness."""

    name: str
    """Row label, e.g. `ring CP=2` or `cp1`."""
    gpus: int
    """Ranks (one GPU each)."""
    flags: list = field(default_factory=list)
    """Flags added to the common ones."""
    env: dict = field(default_factory=dict)
    """Environment overrides (None removes a variable)."""
    baseline: str = "cp1"
    """The CP = 1 run this one is compared with (the same parallel layout and initialization otherwise)."""
    losses: dict = field(default_factory=dict)
    """iteration -> lm loss, parsed from the log."""
    rc: int | None = None
    seconds: float = 0.0
    log: Path | None = None


def model_flags(ns, data_prefix: str) -> list[str]:
    """The run's model, data and optimizer: a small GQA GPT with RoPE, SwiGLU, RMSNorm (Megatron-LM's names)."""
    f = ["--num-layers", str(ns.num_layers), "--hidden-size", str(ns.hidden_size),
         "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "4",
         "--seq-length", str(ns.seq_length), "--max-position-embeddings", str(ns.seq_length),
         "--micro-batch-size", "1", "--global-batch-size", str(ns.global_batch_size),
         "--train-iters", str(ns.iters), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
         "--lr-warmup-iters", "2", "--weight-decay", "0.01", "--clip-grad", "1.0", "--seed", "1234",
         "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
         "--attention-dropout", "0", "--hidden-dropout", "0", "--calculate-per-token-loss",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "257", "--data-path", data_prefix,
         "--split", "100,0,0", "--no-create-attention-mask-in-dataloader", "--log-interval", "1",
         "--eval-iters", "0", "--eval-interval", str(10 ** 6), "--distributed-timeout-minutes", "5"]
    if ns.dtype == "bf16":
        f.append("--bf16")
    if not have_te():
        f += list(NO_TE_FLAGS)
    return f


def plan_runs(ns, n_gpus: int) -> tuple[list[Run], list[str]]:
    """(runs, notes): CP = 1, each algorithm at each CP size that fits, and the optional PP / FSDP runs."""
    runs, notes = [Run("cp1", 1)], []
    for p in ns.cp:
        if p > n_gpus:
            notes.append(f"CP={p}: not run, {n_gpus} GPU(s) present")
            continue
        for a in ns.algos:
            runs.append(Run(f"{a} CP={p}", p, ["--context-parallel-size", str(p), "--context-parallel-algo", a]))
    if ns.pp_run:
        # pipeline stages initialise their layers from per-stage seeds: the baseline is CP = 1 with PP = 2
        pp = ["--pipeline-model-parallel-size", "2"]
        if n_gpus >= 4:
            runs += [Run("cp1 PP=2", 2, pp),
                     Run(f"{ns.pp_run} CP=2 PP=2", 4, ["--context-parallel-size", "2", "--context-parallel-algo",
                                                      ns.pp_run, *pp], baseline="cp1 PP=2")]
        else:
            notes.append(f"PP=2 x CP=2: not run, {n_gpus} GPU(s) present")
    if ns.fsdp_run:
        # Megatron-LM asks for CUDA_DEVICE_MAX_CONNECTIONS unset with FSDP (it overlaps its own communication).
        # Compared with plain CP = 1 (FSDP initialises the same weights): Megatron-FSDP on ONE GPU is not a
        # baseline, in core_v0.16.1 its loss leaves plain Megatron's from the third step (5.3176 vs 5.3117)
        # while FSDP over CP = 2 stays within 1e-6 of plain CP = 1 on both releases.
        fsdp = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
                "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor"]
        runs.append(Run(f"{ns.fsdp_run} CP=2 FSDP", 2, ["--context-parallel-size", "2", "--context-parallel-algo",
                                                       ns.fsdp_run, *fsdp], env={"CUDA_DEVICE_MAX_CONNECTIONS": None}))
    return runs, notes


def make_corpus(mlm_dir: Path, prefix: Path) -> str:
    """A byte-level .bin/.idx of the checkout's Markdown, one document per non-blank line."""
    from .preprocess import preprocess  # noqa: PLC0415

    text = prefix.parent / "corpus.txt"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with open(text, "w", encoding="utf-8") as out:
        for md in sorted(mlm_dir.rglob("*.md")):
            out.write(md.read_text(encoding="utf-8", errors="replace") + "\n")
    preprocess(str(text), str(prefix))
    return str(prefix)


def _launch(run: Run, tree: Path, common: list[str], devices: list[int], port: int, logdir: Path, timeout: float):
    env = dict(os.environ)
    env.update({"CUDA_VISIBLE_DEVICES": ",".join(map(str, devices)), "CUDA_DEVICE_MAX_CONNECTIONS": "1",
                "NCCL_NVLS_ENABLE": env.get("NCCL_NVLS_ENABLE", "0"), "PYTHONUNBUFFERED": "1",
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "4")})
    for k, v in run.env.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    plugin_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(x for x in (plugin_root, env.get("PYTHONPATH")) if x)
    run.log = logdir / (re.sub(r"[^A-Za-z0-9_.-]+", "_", run.name) + ".log")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(run.gpus),
           "--master-port", str(port), "pretrain_gpt.py", *common, *run.flags]
    fh = open(run.log, "w")
    fh.write(" ".join(cmd) + "\n\n")
    fh.flush()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, fh, time.time() + timeout


def execute(runs: list[Run], tree: Path, common: list[str], n_gpus: int, logdir: Path, timeout: float,
            per_gpu: int = 1) -> None:
    """Run the jobs, as many at once as `per_gpu` ranks per GPU allow (largest first; a run's ranks on distinct
    GPUs); kill any past `timeout`."""
    pending = sorted(runs, key=lambda r: -r.gpus)
    free, active, port = [per_gpu] * n_gpus, [], 29500 + os.getpid() % 1000

    def stop(signum, frame):                                      # leave no run behind when we are stopped
        for _, proc, *_ in active:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        raise SystemExit(f"megatron-cp-megatron-lm parity: stopped by signal {signum}")

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        _drive(pending, active, free, port, tree, common, logdir, timeout)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _drive(pending, active, free, port, tree, common, logdir, timeout) -> None:
    while pending or active:
        for run in list(pending):
            devs = sorted(range(len(free)), key=lambda g: -free[g])[:run.gpus]
            if len(devs) == run.gpus and all(free[g] > 0 for g in devs):
                for g in devs:
                    free[g] -= 1
                port += 1
                proc, fh, deadline = _launch(run, tree, common, devs, port, logdir, timeout)
                active.append((run, proc, fh, deadline, devs, time.time()))
                pending.remove(run)
        time.sleep(0.5)
        for item in list(active):
            run, proc, fh, deadline, devs, t0 = item
            if proc.poll() is None and time.time() < deadline:
                continue
            if proc.poll() is None:                               # past its time: the whole process group
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                run.rc = 124
            else:
                run.rc = proc.returncode
            fh.close()
            run.seconds = time.time() - t0
            run.losses = {int(i): float(v) for i, v in LOSS_RE.findall(run.log.read_text(errors="replace"))}
            for g in devs:
                free[g] += 1
            active.remove(item)
            print(f"  {run.name}: exit {run.rc}, {len(run.losses)} iterations, {run.seconds:.0f} s", flush=True)
            if run.rc != 0:                                       # the end of its log says why
                tail = [ln for ln in run.log.read_text(errors="replace").splitlines() if ln.strip()][-12:]
                print("    | " + "\n    | ".join(tail), flush=True)


def report(runs: list[Run], iters: int, tol: float) -> tuple[str, bool]:
    """(markdown: per baseline, a table of the loss per iteration with each run's difference from it, then one
    PASS / FAIL line per run; passed)."""
    by_name = {r.name: r for r in runs}
    lines, ok = [], True
    for base in [r for r in runs if r.name.startswith("cp1")]:
        group = [r for r in runs if r.baseline == base.name and not r.name.startswith("cp1")]
        lines += ["| iter | " + " | ".join([base.name] + [r.name for r in group]) + " |",
                  "|---" * (len(group) + 2) + "|"]
        for it in range(1, iters + 1):
            b = base.losses.get(it)
            row = [str(it), "-" if b is None else f"{b:.6f}"]
            row += ["-" if r.losses.get(it) is None or b is None else f"{r.losses[it]:.6f} ({r.losses[it] - b:+.1e})"
                    for r in group]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    for r in runs:
        complete = r.rc == 0 and len(r.losses) == iters
        base = by_name.get(r.baseline)
        if r.name.startswith("cp1"):
            ok &= complete
            if not complete:
                lines.append(f"- {r.name}: FAIL (exit {r.rc}, {len(r.losses)}/{iters} iterations, log {r.log})")
            continue
        diffs = [abs(v - base.losses[i]) for i, v in r.losses.items() if base is not None and i in base.losses]
        worst = max(diffs) if len(diffs) == iters else float("nan")
        good = complete and worst <= tol
        ok &= good
        lines.append(f"- {r.name}: {'PASS' if good else 'FAIL'} (exit {r.rc}, {len(r.losses)}/{iters} iterations, "
                     f"max |loss - {r.baseline}| {worst:.2e}, tol {tol:g}, {r.seconds:.0f} s"
                     f"{'' if r.rc == 0 else ', log ' + str(r.log)})")
    return "\n".join(lines), ok


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-cp-megatron-lm parity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("megatron_lm", metavar="MEGATRON_LM_DIR", help="a Megatron-LM checkout (not modified)")
    a("--cp", type=int, nargs="+", default=[2, 4], help="CP sizes (those above the GPU count are skipped)")
    a("--algos", nargs="+", default=list(registry.names()), choices=registry.flag_choices())
    a("--pp-run", metavar="ALGO", default=None, help="also PP = 2 x CP = 2 with ALGO (4 GPUs)")
    a("--fsdp-run", metavar="ALGO", default=None, help="also Megatron-FSDP (optim_grads_params) x CP = 2 with ALGO")
    a("--dtype", choices=tuple(TOL), default="fp32")
    a("--tol", type=float, default=None, help="max |loss - CP=1 loss| per iteration (default: fp32 1e-5, bf16 2e-2)")
    a("--iters", type=int, default=10)
    a("--num-layers", type=int, default=4)
    a("--hidden-size", type=int, default=256)
    a("--seq-length", type=int, default=1024)
    a("--global-batch-size", type=int, default=4)
    a("--workdir", default=None, help="where the patched copy, data and logs go (default: a new temp dir)")
    a("--timeout", type=float, default=600, help="seconds per run before it is killed")
    a("--runs-per-gpu", type=int, default=4, help="ranks of different runs sharing one GPU (the model is small; "
      "start-up, ~45 s of imports and initialisation per run on an H200 host, dominates)")
    a("--out", default=None, help="also write the report (markdown) here")
    a("--force", action="store_true",
      help="a Megatron-LM release whose patch is not yet verified on GPUs (core_v0.17, 0.18: its own patch), or one "
           "no patch was made for (the nearest that applies)")
    return p


def main(argv=None) -> int:
    ns = build_parser().parse_args(argv)
    mlm = Path(ns.megatron_lm).resolve()
    tol = TOL[ns.dtype] if ns.tol is None else ns.tol
    for p in ns.cp:
        if p < 2 or ns.seq_length % registry.any_divisor(p):
            print(f"megatron-cp-megatron-lm parity: error: --cp {p}: must be >= 2 and divide --seq-length "
                  f"{ns.seq_length} / 2", file=sys.stderr)
            return 2
    try:
        rel = release_of(mlm)
        patch_for(mlm, ns.force)                 # refuses an unsupported release before any copy or GPU work
    except ValueError as e:
        print(f"megatron-cp-megatron-lm parity: error: {e}", file=sys.stderr)
        return 2
    import torch  # noqa: PLC0415

    n_gpus = torch.cuda.device_count()
    if n_gpus == 0:
        print("megatron-cp-megatron-lm parity: no GPU: Megatron-LM's training loop requires CUDA "
              "(megatron/training/initialize.py asserts it); nothing was run", file=sys.stderr)
        return 3
    work = Path(ns.workdir or tempfile.mkdtemp(prefix="mcp-megatron-lm-")).resolve()
    tree = copy_checkout(mlm, work / "Megatron-LM")
    patch = apply_patch(tree, ns.force)
    data = make_corpus(mlm, work / "data" / "corpus")
    (work / "logs").mkdir(exist_ok=True)
    runs, notes = plan_runs(ns, n_gpus)
    print(f"megatron-cp-megatron-lm parity: Megatron-LM {mlm} (megatron-core {'.'.join(map(str, rel))}), "
          f"{patch.name}, {n_gpus} GPU(s), {ns.dtype}, {len(runs)} runs, work dir {work}", flush=True)
    execute(runs, tree, model_flags(ns, data), n_gpus, work / "logs", ns.timeout, ns.runs_per_gpu)
    table, ok = report(runs, ns.iters, tol)
    text = "\n".join([table, *[f"- {n}" for n in notes], "", f"RESULT: {'PASS' if ok else 'FAIL'}"])
    print(text)
    if ns.out:
        Path(ns.out).write_text(f"megatron-core {'.'.join(map(str, rel))}, {patch.name}\n\n{text}\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
