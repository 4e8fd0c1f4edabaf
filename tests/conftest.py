"""Shared fixtures: `pools(P)` gives a DistPool of P gloo processes, started once per test module."""
from __future__ import annotations

import os
import time

import pytest
import torch

# Triton kernels (flash_decode, DeFT) are tested on CPU through Triton's interpreter. triton.jit reads the
# variable when a kernel module is imported, so it is set here, before any test imports one; gloo workers
# inherit it. On GPUs the real kernels run.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    # On a GPU machine every multi-rank run (trainer, generation, benchmarks under torchrun) shares the GPUs
    # present over gloo (devices.py), so that one GPU runs the whole suite; a test of the refusal unsets it.
    os.environ.setdefault("MCP_SHARE_GPU", "1")

from .dist_pool import DistPool


def pytest_runtest_logreport(report):
    """MCP_FAILURE_LOG=path: each failing test's id and the end of its report, appended as it fails (on the xdist
    controller), so that a run killed by its time limit before pytest's summary still names and shows its failures
    (scripts/gpu_tests.sh sets it)."""
    path = os.environ.get("MCP_FAILURE_LOG")
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:   # workers relay theirs to the controller
        with open(path, "a") as f:
            f.write(f"FAILED {report.nodeid} ({report.when})\n")
            f.write("".join(f"    {ln}\n" for ln in report.longreprtext[-4000:].splitlines()))   # its last lines


def done_in(run_dirs: str) -> set[str]:
    """The tests that finished and did not fail in earlier runs of scripts/gpu_tests.sh: each of `run_dirs`
    (space-separated) holds one run's running.txt (start / end lines, `pytest_runtest_logstart`) and failures.txt
    (`pytest_runtest_logreport`). A test that started but never ended (the run's limit cut it) is not done."""
    def lines(d, name):
        try:
            with open(os.path.join(d, name)) as f:
                return f.read().splitlines()
        except FileNotFoundError:
            return []

    done, failed = set(), set()
    for d in run_dirs.split():
        done.update(ln.split("\t", 2)[2] for ln in lines(d, "running.txt") if ln.startswith("end\t"))
        failed.update(ln[len("FAILED "):].rsplit(" (", 1)[0] for ln in lines(d, "failures.txt")
                      if ln.startswith("FAILED "))
    return done - failed


def _skip_done(config, items) -> None:
    """MCP_DONE_RUNS="dir ..." (gpu_tests.sh's REST): deselect what earlier runs finished (`done_in`), so that on a
    machine where the suite needs several calls under a time limit (one H200: three of about 10 minutes) each call
    runs only what the earlier calls cut off or failed."""
    runs = os.environ.get("MCP_DONE_RUNS")
    if not runs:
        return
    done = done_in(runs)
    drop = [it for it in items if it.nodeid in done]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [it for it in items if it.nodeid not in done]


def pytest_collection_modifyitems(config, items):
    """MCP_DONE_RUNS: see `_skip_done`. Then MCP_LONG_TESTS=path ("seconds<TAB>test id" lines,
    scripts/test_long.tsv): the listed tests run first, longest first, each followed by one unlisted test, the rest
    in collection order. xdist (`--maxschedchunk 1`) hands each worker two consecutive tests at the start and
    refills one or two at a time, so a long test right behind another waits for it on one worker: on 2 x H200 the
    two checkpoint-resume tests (about 160 s each) ran one after the other from 110 s into the shard and the second
    was cut off by its limit (2026-11-27 and -28). Replaying that shard's measured times through xdist's scheduling
    gives 330 s in this order against 435 s in file order."""
    _skip_done(config, items)
    path = os.environ.get("MCP_LONG_TESTS")
    if not path:
        return
    secs = {}
    with open(path) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                t, nodeid = line.rstrip("\n").split("\t", 1)
                secs[nodeid] = float(t)
    long = sorted((it for it in items if it.nodeid in secs), key=lambda it: -secs[it.nodeid])
    short = [it for it in items if it.nodeid not in secs]
    order = []
    for i, it in enumerate(long):
        order += [it] + short[i:i + 1]
    items[:] = order + short[len(long):]


def _running_log(line: str) -> None:
    path = os.environ.get("MCP_RUNNING_LOG")
    if path and "PYTEST_XDIST_WORKER" not in os.environ:                    # xdist relays both to the controller
        with open(path, "a") as f:
            f.write(line)


def pytest_runtest_logstart(nodeid, location):
    """MCP_RUNNING_LOG=path: a line when each test starts and one when it ends, so that a run cut off by its time
    limit names the tests it was still running (scripts/gpu_tests.sh: the 2 x H200 shard 2 of 2026-11-27 was cut
    twice at 953 of 954 tests, with nothing to say which one)."""
    _running_log(f"start\t{time.time():.0f}\t{nodeid}\n")


def pytest_runtest_logfinish(nodeid, location):
    _running_log(f"end\t{time.time():.0f}\t{nodeid}\n")


@pytest.fixture(autouse=True)
def _return_cached_gpu_memory():
    """After each test, a process that used CUDA gives its allocator's cached blocks back to the device: on a GPU
    machine 20 xdist workers live through the whole suite beside the trainer's and torchrun's rank processes, and
    memory one worker keeps cached is memory a rank cannot have (shard 2 on 2 x H100, 2026-11-28: 4 tests failed
    with CUDA out of memory when their ranks created their contexts)."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def pools():
    made = {}

    def get(p):
        if p not in made:
            made[p] = DistPool(p)
        return made[p]

    yield get
    for pool in made.values():
        pool.close()
