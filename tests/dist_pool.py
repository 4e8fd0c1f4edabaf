"""A pool of processes that share one gloo process group, started once per test module.

`pool.run(fn, *args)` calls `fn(rank, world_size, *args)` on every rank (fn must be a module-level function)
and returns the per-rank results; an exception on any rank fails the call with that rank's traceback, and a
rank that does not answer within `timeout` seconds (a hang) fails it too.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback

from megatron_cp_plugin import cp_grid
from megatron_cp_plugin.comm import init_group, serve_store


SHIPPED_OVERLAP_MIN_LOCAL = cp_grid.OVERLAP_MIN_LOCAL


def _worker(rank, world, port, tasks, results):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # The tests' shards are tens of tokens: with the shipped threshold Attention2D-O would run Attention2D-NO's
    # schedule on every one of them (cp_grid.overlap_pays), so its own is what the ranks run unless a test sets it back
    # (SHIPPED_OVERLAP_MIN_LOCAL). Tests that compare with the test process's formulas set it there too.
    cp_grid.OVERLAP_MIN_LOCAL = 0
    init_group("gloo", rank, world, port)
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args = item
        try:
            results.put((rank, True, fn(rank, world, *args)))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            results.put((rank, False, (type(e).__name__, str(e), traceback.format_exc())))
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()        # a pool lives through its module: its cache is memory others lack
    dist.destroy_process_group()


class RankError(Exception):
    def __init__(self, failures):
        self.failures = failures  # {rank: (type name, message, traceback)}
        first = next(iter(failures.values()))
        super().__init__(f"ranks {sorted(failures)} failed; first traceback:\n{first[2]}")


def _context():
    """A forkserver that has imported torch, megatron-core and the plugin once: every rank of every pool is a
    fork of it (~0.1 s) instead of a fresh interpreter importing them (~3 s of CPU each, 7 s with
    megatron-core; 33 ranks for test_cp_attention alone on CI's 2 cores). Nothing in it has run a kernel or
    started a thread pool, so the forks are clean; the ranks create their process groups after the fork.
    On a GPU machine the ranks are spawned instead: an import there may touch CUDA (megatron-core's did, and a
    fork then cannot use CUDA again: "Cannot re-initialize CUDA in forked subprocess"), and the ranks' tensors
    live on the GPU, shared over gloo as in the shared-GPU mode (devices.py)."""
    import torch

    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "megatron_cp_plugin", "megatron.core",
                                "tests.dist_pool"])
    return ctx


class DistPool:
    def __init__(self, world_size: int):
        ctx = _context()
        self.world = world_size
        self.store = serve_store()      # the ranks' rendezvous, bound while the pool lives (no port race)
        port = self.store.port
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results), daemon=True)
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run_outcomes(self, fn, *args, timeout: float = 300):
        """{rank: (ok, value)}, where value is the result or (exception type name, message, traceback)."""
        for t in self.tasks:
            t.put((fn, args))
        out = {}
        try:
            while len(out) < self.world:
                rank, ok, val = self.results.get(timeout=timeout)
                out[rank] = (ok, val)
        except queue.Empty:
            self.close(kill=True)
            raise TimeoutError(f"ranks {sorted(set(range(self.world)) - set(out))} did not answer in {timeout} s "
                               f"(a hang); the pool was killed") from None
        return out

    def run(self, fn, *args, timeout: float = 300):
        """[result of rank 0, ..., result of rank P-1]; RankError if any rank raised."""
        out = self.run_outcomes(fn, *args, timeout=timeout)
        failures = {r: v for r, (ok, v) in out.items() if not ok}
        if failures:
            raise RankError(failures)
        return [out[r][1] for r in range(self.world)]

    def close(self, kill: bool = True):
        """End the ranks. By default they are killed: a test's pool holds nothing worth a clean exit, and a
        clean exit (gloo teardown, the interpreter freeing its heap) took up to 15 s per module on CI's CPU.
        kill=False asks each rank to leave its process group first and waits up to 30 s."""
        for p, t in zip(self.procs, self.tasks):
            if not kill and p.is_alive():
                t.put(None)
        for p in self.procs:
            if kill:
                p.kill()
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
