"""A real SLURM cluster on this host (launch/slurm_ci.sh: slurm-wlm + munge, two slurmd as two "nodes"): the
launch scripts train the tiny config on 2 nodes x 2 ranks (CP = 4) with every algorithm, each job exits 0
and its losses equal CP = 1's; a failing run ends its job non-zero. Skips where SLURM cannot be installed, and
where it would have to be (apt-get) or the node names added to /etc/hosts without MCP_ALLOW_SYSTEM_CHANGES=1
(.ci/run sets it): a test changes no system state unless asked."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# One algorithm per layout (zigzag, cyclic): the sweep's machinery is what this tests; every algorithm's numbers
# at 4 ranks are tests/test_pretrain.py's and test_cp_attention.py's (the four took 63 s of the suite's time).
ALGOS = ("ring", "attention2d-o")
ITERS = 6
TOL = 1e-4                                       # as tests/test_pretrain.py
JOB_TIMEOUT = 240


def _free_port_block(n=3) -> int:
    """A port p with p .. p+n-1 free (slurmctld, then one slurmd per node), so a cluster left over by
    someone else on the default ports does not collide."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port block")


def _sh(cmd, env, timeout=120, **kw):
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout, **kw)


@pytest.fixture(scope="module")
def cluster():
    """Environment for SLURM clients of a fresh 2-node cluster; brought down (its own PIDs only) afterwards."""
    if shutil.which("slurmctld") is None and os.environ.get("MCP_ALLOW_SYSTEM_CHANGES") != "1":
        pytest.skip("SLURM is not installed; MCP_ALLOW_SYSTEM_CHANGES=1 lets this test install slurm-wlm + munge "
                    "with apt-get and add its node names to /etc/hosts (CI's .ci/run sets it)")
    if shutil.which("slurmctld") is None and (os.geteuid() != 0 or shutil.which("apt-get") is None):
        pytest.skip("SLURM is not installed and cannot be here (needs root and apt-get for slurm-wlm + munge)")
    state = tempfile.mkdtemp(prefix="mcp-slurm-", dir="/tmp")    # short: munge's socket path lives in it
    env = {**os.environ, "MCP_SLURM_DIR": state, "MCP_SLURM_NODES": "2", "MCP_SLURM_CPUS": "2",
           "MCP_SLURM_PORT": str(_free_port_block()), "SLURM_CONF": f"{state}/slurm.conf",
           "PYTHONWARNINGS": "ignore"}
    for var in [v for v in env if v.startswith("SLURM_") and v != "SLURM_CONF"]:
        del env[var]                             # pytest itself may run inside someone's allocation
    up = _sh(["bash", "launch/slurm_ci.sh", "up"], env, timeout=600)
    if up.returncode == 3:
        shutil.rmtree(state, ignore_errors=True)
        pytest.skip(f"SLURM cannot be installed here: {up.stderr.strip().splitlines()[-1]}")
    try:
        assert up.returncode == 0, f"slurm_ci.sh up failed:\n{up.stdout}\n{up.stderr[-4000:]}"
        yield env
    finally:
        down = _sh(["bash", "launch/slurm_ci.sh", "down"], env, timeout=300)
        shutil.rmtree(state, ignore_errors=True)
        assert down.returncode == 0, down.stderr[-2000:]


@pytest.fixture(scope="module")
def cp1_losses(tmp_path_factory):
    """The same model with CP = 1: one process, launch/local.sh."""
    out = tmp_path_factory.mktemp("cp1")
    env = {**os.environ, "CONFIG": "configs/tiny.toml", "ALGO": "ring", "NPROC_PER_NODE": "1",
           "EXTRA_ARGS": f"--train-iters {ITERS}", "RESULT_DIR": str(out), "RUN_NAME": "cp1",
           "PYTHON": sys.executable, "PYTHONWARNINGS": "ignore"}
    env.pop("SLURM_JOB_ID", None)
    r = _sh(["bash", "launch/local.sh"], env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads((out / "cp1.json").read_text())
    assert res["status"] == "ok" and res["cp_size"] == 1 and len(res["losses"]) == ITERS
    return res["losses"]


def _job(env, job_id) -> dict:
    """The job's record as slurmctld has it: JobState, ExitCode, NumNodes, ..."""
    r = _sh(["scontrol", "show", "job", "-o", job_id], env)
    assert r.returncode == 0, r.stderr
    return dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv)


def test_sweep_on_2_nodes_x_2_ranks_matches_cp1(cluster, cp1_losses, tmp_path):
    out = tmp_path / "sweep"
    # the jobs are submitted at once; --exclusive makes SLURM run them one after another on the 2 cores
    r = _sh([sys.executable, "launch/sweep.py", "--config", "configs/tiny.toml", "--seq", "256", "--nodes", "2",
             "--nproc-per-node", "2", "--algos", *ALGOS, "--extra-args", f"--train-iters {ITERS}",
             "--result-dir", str(out), "--poll", "1", "--timeout", str(JOB_TIMEOUT * len(ALGOS))],
            cluster, timeout=JOB_TIMEOUT * len(ALGOS) + 60)
    logs = "".join(p.read_text()[-1500:] for p in out.glob("*.out")) if out.exists() else ""
    assert r.returncode == 0, r.stdout + r.stderr[-3000:] + logs
    runs = json.loads((out / "sweep.json").read_text())["runs"]
    assert sorted(run["algo"] for run in runs) == sorted(ALGOS)
    for run in runs:
        job = _job(cluster, run["job_id"])                 # not the sweep's word for it: slurmctld's
        assert (job["JobState"], job["ExitCode"], job["NumNodes"]) == ("COMPLETED", "0:0", "2"), job
        res = json.loads((out / run["result"]).read_text())
        assert res["status"] == "ok" and res["slurm_job_id"] == run["job_id"]
        assert (res["algo"], res["nodes"], res["ranks_per_node"], res["cp_size"]) == (run["algo"], 2, 2, 4)
        assert len(res["losses"]) == ITERS
        diff = max(abs(a - b) for a, b in zip(res["losses"], cp1_losses))
        assert diff <= TOL, (run["algo"], res["losses"], cp1_losses)
        log = (out / run["log"]).read_text()
        logged = [float(m) for m in re.findall(r"^iter +\d+ \| loss ([0-9.]+)", log, re.M)]
        assert len(logged) == ITERS, run["log"]                # rank 0's log lines reached the job's output
        assert max(abs(a - b) for a, b in zip(logged, cp1_losses)) <= TOL, (run["algo"], logged, cp1_losses)
    summary = (out / "summary.md").read_text()
    rows = [line for line in summary.splitlines() if re.match(r"\| 256 \| ", line)]
    assert len(rows) == len(ALGOS) and all("| COMPLETED | 0:0 |" in row for row in rows), summary


def test_failing_run_ends_its_job_nonzero(cluster, tmp_path):
    """sbatch launch/scaling.sbatch directly; the job is polled with squeue (not sbatch --wait)."""
    env = {**cluster, "CONFIG": "configs/tiny.toml", "ALGO": "attention2d-no", "NPROC_PER_NODE": "2",
           "EXTRA_ARGS": "--train-iters 2 --cp-grid 3x1", "RESULT_DIR": str(tmp_path), "RUN_NAME": "bad",
           "PYTHON": sys.executable, "REPO": str(REPO)}
    r = _sh(["sbatch", "--parsable", "--nodes=2", f"--output={tmp_path}/bad.out", "launch/scaling.sbatch"], env)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip().split(";")[0]
    t0 = time.time()
    while _sh(["squeue", "-h", "-j", job_id, "-o", "%T"], env).stdout.strip() not in ("", "COMPLETED", "FAILED"):
        assert time.time() - t0 < JOB_TIMEOUT, f"job {job_id} still queued"
        time.sleep(1)
    job = _job(env, job_id)
    assert job["JobState"] == "FAILED" and job["ExitCode"] != "0:0", job
    res = json.loads((tmp_path / "bad.json").read_text())
    assert res["status"] == "failed" and "--cp-grid" in res["error"]


def test_sweep_dry_run_and_summarize_need_no_cluster(tmp_path):
    r = subprocess.run([sys.executable, "launch/sweep.py", "--dry-run", "--config", "configs/gpt3-13b.toml",
                        "--seq", "65536", "131072", "--algos", "ring", "attention2d-o", "--nodes", "16",
                        "--gpus-per-node", "4", "--partition", "gpu", "--account", "proj", "--recompute-from-seq",
                        "131072", "--result-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 4
    assert all("--nodes=16" in x and "--gpus-per-node=4" in x and "--partition=gpu" in x and "--account=proj" in x
               and "NPROC_PER_NODE=4" in x and x.endswith("launch/scaling.sbatch") for x in lines)
    assert sum("recompute-full.toml" in x for x in lines) == 2 and "SEQ=131072" in lines[-1]
    runs = [{"name": f"r{i}", "seq": 1024, "algo": a, "nodes": 1, "nproc_per_node": 2, "configs": ["c.toml"],
             "result": f"r{i}.json", "log": f"r{i}.out", "job_id": str(i), "state": "COMPLETED", "exit_code": "0:0"}
            for i, a in enumerate(("ring", "attention2d-no"))]
    (tmp_path / "sweep.json").write_text(json.dumps({"runs": runs}))
    for i, step in enumerate((2.0, 0.5)):
        (tmp_path / f"r{i}.json").write_text(json.dumps({"status": "ok", "cp_size": 2, "step_time_median_s": step}))
    r = subprocess.run([sys.executable, "launch/sweep.py", "--summarize", str(tmp_path)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    row = next(x for x in (tmp_path / "summary.md").read_text().splitlines() if "attention2d-no" in x)
    assert row.rstrip().endswith("| 4.00 |")                 # ring's 2.0 s / 0.5 s


# ------------------------------------------------ the launch scripts' memory plan (no cluster: DRY_RUN, a fake srun)
def _launch(script, tmp_path, **env):
    e = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    e.update({"PYTHON": sys.executable, "RESULT_DIR": str(tmp_path / "results"), "GPU_MEM": "80",
              "PYTHONWARNINGS": "ignore", **env})
    e = {k: v for k, v in e.items() if v is not None}                  # None: unset
    return subprocess.run(["bash", script], cwd=REPO, env=e, capture_output=True, text=True, timeout=120)


def test_sbatch_dry_run_prints_the_plan_and_picks_a_layout_that_fits(tmp_path):
    # docs/slurm.md's example: GPT-3 13B at SEQ=65536 on the script's 4 nodes x 4 GPUs of 80 GB; the config's own
    # layout (zero1) needs 112 GiB there, so auto must pick another
    r = _launch("launch/gpt3-13b.sbatch", tmp_path, DRY_RUN="1", SEQ="65536")
    assert r.returncode == 0, r.stderr
    plans = [x for x in r.stdout.splitlines() if x.startswith("plan:")]
    assert plans == ["plan: 68.0 GiB per GPU of 80 GiB (fsdp-optim_grads)"], r.stdout
    assert "4 nodes x 4 ranks" in r.stdout
    cmd = r.stdout.strip().splitlines()[-1]
    assert cmd.endswith("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads"), cmd


def _fake_srun(tmp_path):
    """A srun that logs its arguments and runs only the prepare step (`env ... prepare.sh`), inside a fake
    container when given --container-image: a PATH whose python3 logs 'container' (and skips the patch);
    the host's python3 logs 'host'."""
    bin_, cbin, hbin = (tmp_path / d for d in ("bin", "cbin", "hbin"))
    for d in (bin_, cbin, hbin):
        d.mkdir()
    log = tmp_path / "calls.log"
    (bin_ / "srun").write_text(f"""#!/usr/bin/env bash
echo "srun $*" >> {log}
c=0
while [[ $1 == -* ]]; do [[ $1 == --container-image=* ]] && c=1; shift; done
[[ $c == 1 ]] && export PATH={cbin}:$PATH
[[ $1 == env ]] && exec "$@"
exit 0
""")
    (cbin / "python3").write_text(f"""#!/usr/bin/env bash
echo "container python3 $*" >> {log}
[[ "$*" == *megatron_lm.cli\\ patch* ]] && exit 0
exec {sys.executable} "$@"
""")
    (hbin / "python3").write_text(f"""#!/usr/bin/env bash
echo "host python3 $*" >> {log}
exec {sys.executable} "$@"
""")
    for f in (bin_ / "srun", cbin / "python3", hbin / "python3"):
        f.chmod(0o755)
    path = f"{bin_}:{hbin}:{os.environ['PATH']}"
    alloc = dict(SLURM_JOB_ID="7", SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="n1", MASTER_ADDR="n1",
                 NPROC_PER_NODE="2", PATH=path)
    return log, alloc


def test_a_run_that_fits_nothing_is_refused_and_nothing_is_submitted(tmp_path):
    log, alloc = _fake_srun(tmp_path)
    alloc.update(SLURM_JOB_NUM_NODES="8", NPROC_PER_NODE="1")       # 175B on 8 GPUs of 80 GB
    r = _launch("launch/gpt3-175b.sbatch", tmp_path, PYTHON=str(tmp_path / "hbin/python3"), **alloc)
    assert r.returncode == 3, r.stdout + r.stderr
    err = [x for x in r.stderr.splitlines() if x.startswith("launch:")]
    assert len(err) == 1 and err[0].startswith("launch: no layout fits 80 GiB GPUs (175.2B parameters"), r.stderr
    assert "srun" not in (log.read_text() if log.exists() else "")      # no step was started
    assert "torch.distributed.run" not in r.stdout


def test_with_a_container_every_step_runs_inside_it(tmp_path):
    fake = tmp_path / "Megatron-LM"
    fake.mkdir()
    (fake / "pretrain_gpt.py").write_text("")
    log, alloc = _fake_srun(tmp_path)
    # PYTHON unset: in the container, its python3
    r = _launch("launch/scaling.sbatch", tmp_path, CONTAINER="img.sqsh", TRAINER="megatron-lm",
                MEGATRON_LM=str(fake), CONFIG="configs/tiny.toml", PYTHON=None, **alloc)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = log.read_text().splitlines()
    assert not [c for c in calls if c.startswith("host ")], calls        # the host's Python ran nothing
    inside = [c for c in calls if c.startswith("container python3 ")]
    assert any("megatron_cp_plugin.bench.launch_plan --trainer megatron-lm" in c for c in inside), calls
    assert any("megatron_lm.cli patch " + str(fake) in c for c in inside), calls
    steps = [c for c in calls if c.startswith("srun ")]
    assert len(steps) == 2 and all("--container-image=img.sqsh" in s for s in steps), steps
    assert "--nodes=1 --ntasks=1" in steps[0] and "prepare.sh" in steps[0]            # one step: plan, flags, patch
    assert f"--container-mounts={REPO}:{REPO},{fake}:{fake}" in steps[1]
    assert "torch.distributed.run" in steps[1] and "pretrain_gpt.py" in steps[1] and "--mock-data" in steps[1]
    assert re.search(r"^plan: [0-9.]+ GiB per GPU of 80 GiB \(ddp\)$", r.stdout, re.M), r.stdout   # tiny's own
