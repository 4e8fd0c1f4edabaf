"""Starting the ranks: under torchrun as they are, or --nproc local processes spawned here; a failing rank
prints its error, records the failure (--result-json) and exits non-zero without waiting for its peers, whose
next collective then fails (or times out after --dist-timeout seconds), so a job never hangs silently. Spawned
ranks are watched by the launching process (training.watchdog): failed, killed or frozen ranks and Ctrl-C end
the job promptly, with no process left behind.
`--compare-cp1` runs CP = 1 and then the requested run and prints their losses side by side."""
from __future__ import annotations

import datetime
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from .. import devices
from ..comm import init_group
from .report import write_record


def run_rank(rank: int, world: int, args, port: int | None, target, lone: bool = False) -> None:
    """One rank: set up the process group (torchrun's env, the launcher's store at `port` for a spawned rank, or
    a store of its own when `lone`: one rank, no launcher), run target(args), exit non-zero on error."""
    try:
        if port is not None:
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        share = devices.sharing(getattr(args, "share_gpu", False))
        if port is None and not lone:       # torchrun / SLURM: the launcher was not ours, so check here
            devices.refuse_unshared_ranks(getattr(args, "prog", "megatron-cp-pretrain"), share)
        if getattr(args, "deterministic_mode", False):
            # cuBLAS picks its workspace (and with it the reduction order) when its handle is made: before CUDA
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        gpu = torch.cuda.is_available()
        if gpu:
            torch.cuda.set_device(devices.rank_device(int(os.environ.get("LOCAL_RANK", 0))))
        else:
            from ..megatron.cpu_shim import apply_cpu_shims
            apply_cpu_shims()
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", 1))))
        # NCCL: a collective that outlives the timeout ends the process (torch >= 2.2's default, kept unless
        # the user chose otherwise); gloo times out each collective by itself.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        if port is not None or lone:        # our launcher's store (or our own): no port is picked and released
            init_group(devices.backend(share), rank, world, port, args.dist_timeout)
        else:
            dist.init_process_group(devices.backend(share), timeout=datetime.timedelta(seconds=args.dist_timeout))
        target(args)
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - report, then leave without waiting for peers
        print(f"[rank {os.environ.get('RANK', rank)}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        try:
            write_record(args, "failed", f"{type(e).__name__}: {e}")
        except Exception:  # noqa: BLE001 - the exit status matters more than the record
            pass
        from .watchdog import kill_own_helpers
        kill_own_helpers()
        os._exit(1)


def _spawned_rank(rank: int, world: int, args, port: int, target, beats, parent: int) -> None:
    """Entry point of a rank spawned by launch(): heartbeat and parent-death guard first, then run_rank."""
    from .watchdog import guard_rank
    guard_rank(beats, rank, parent)
    run_rank(rank, world, args, port, target)
    # Done: its files written and closed (saves are synchronous), its process group destroyed. Skip the
    # interpreter's teardown, which took 1.9 s per rank on a 2-core CPU after a tiny run; os._exit runs no
    # finalizer, so end what the rank started (dist_checkpointing's Manager process) here, or it would
    # outlive the job holding its output pipes.
    from .watchdog import kill_own_helpers
    sys.stdout.flush()
    sys.stderr.flush()
    kill_own_helpers()
    os._exit(0)


def launch(args, target, prog: str = "megatron-cp-pretrain") -> None:
    """Run target(args) on every rank: under torchrun as is, else in --nproc spawned processes watched by this
    one (training.watchdog): a rank that fails, is killed or freezes for --dist-timeout seconds, or SIGINT /
    SIGTERM here, ends the job with one line naming the cause and no process left behind. With spawned ranks
    this process exits when they are done (status 0, or the failure's), so launch() does not return."""
    from ..comm import serve_store

    args.prog = prog
    if "RANK" not in os.environ and args.nproc and args.nproc > 1:
        refuse = devices.too_many_ranks(args.nproc, devices.sharing(getattr(args, "share_gpu", False)))
        if refuse:                         # in the launching process, before any rank starts
            print(f"{prog}: error: {refuse}", file=sys.stderr)
            write_record(args, "failed", refuse, exit_code=2)
            sys.exit(2)
    if getattr(args, "share_gpu", False):
        devices.enable_sharing()           # the ranks (and what they start) see it too
    if "RANK" in os.environ or not args.nproc or args.nproc == 1:
        lone = "RANK" not in os.environ          # one rank started by hand: it serves its own store
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None, target, lone=lone)
        return
    import multiprocessing

    from .watchdog import adopt_orphans, kill_descendants, supervise
    adopt_orphans()
    ctx = multiprocessing.get_context("spawn")
    beats = ctx.RawArray("d", args.nproc)       # lock-free shared memory: no semaphore for a tracker to own
    store = serve_store(args.dist_timeout)     # bound until this process exits: the ranks' rendezvous
    port = store.port
    procs = [ctx.Process(target=_spawned_rank, args=(r, args.nproc, args, port, target, beats, os.getpid()),
                         name=f"rank{r}") for r in range(args.nproc)]
    try:
        for p in procs:
            p.start()
    except BaseException:
        kill_descendants([p for p in procs if p.pid is not None])
        raise
    status = supervise(procs, beats, args.dist_timeout, prog)
    if status == 0:
        kill_descendants(procs)   # an orphan a rank left (adopted here): nothing of the job outlives it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)              # every rank has exited: skip multiprocessing's atexit joins (0.6 s)


def _train(args):
    """training.loop.train, imported in the rank: the launching process never imports megatron-core."""
    from .loop import train
    return train(args)


def check_world(args) -> None:
    """The start-up checks that need the world size (validate_args) or read the checkpoint directories (--save,
    --load), run before any process group exists: in the launching process for --nproc, or in each torchrun /
    SLURM rank before its first collective. A bad flag ends the job with one line (rank 0's; the other ranks
    exit 2 silently, after a grace period: `_fail_at_start`) and a failed --result-json. train() repeats them (it
    may be called without main())."""
    import copy

    from .checkpoint import check_resumable, check_save_dir
    from .config import validate_args
    world = int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ else (args.nproc or 1)
    try:
        checked = copy.deepcopy(args)
        validate_args(checked, world, log=False)       # the ranks print the cost model's choice
        check_save_dir(checked)
        if checked.load:
            check_resumable(checked)
    except ValueError as e:
        _fail_at_start(args, str(e))


def check_memory(args) -> None:
    """The memory plan against the GPUs (training/memory_check.py), in the launching process for --nproc or in
    each torchrun / SLURM rank before its first collective: a run that will not fit ends here in one line (rank
    0's) naming the layouts that fit. Then the allocator default for the ranks (expandable segments)."""
    from .memory_check import allocator_env, refusal
    world = int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ else (args.nproc or 1)
    line = refusal(args, world)
    if line:
        _fail_at_start(args, line)
    allocator_env()


PEER_EXIT_GRACE_S = 15.0
"""Seconds a rank other than 0 waits before it exits on a bad start-up flag. torchrun ends a node's other ranks as
soon as one fails, so a rank 1 that exited at once could have rank 0 killed before it printed the line and wrote
the run record (CI, 2 SLURM nodes x 2 ranks on 2 cores, 2026-11-27: rank 0 SIGTERMed, no --result-json). Rank 0
fails on the same check (every rank runs it on the same flags), and its exit ends the job sooner."""


def _fail_at_start(args, line: str) -> None:
    """End this rank on a start-up error: rank 0 prints `line`, records the failure and exits 2; the others exit 2
    silently after PEER_EXIT_GRACE_S, so that rank 0 has reported before torchrun stops them."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"megatron-cp-pretrain: error: {line}", file=sys.stderr)
        write_record(args, "failed", line, exit_code=2)
    else:
        time.sleep(PEER_EXIT_GRACE_S)
    sys.exit(2)


def _drop_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """argv without `flags` and their values (`--flag V` and `--flag=V`)."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x in flags:
            skip = True
        elif not x.startswith(tuple(f + "=" for f in flags)):
            out.append(x)
    return out


def compare_cp1(argv: list[str], args) -> None:
    """Run CP = 1 and then the requested run as subprocesses; print their losses side by side."""
    import json
    import subprocess
    import tempfile

    from ..megatron.batch import packed_unit

    tmp = tempfile.mkdtemp(prefix="megatron-cp-compare-")
    base = _drop_flags([x for x in argv if x != "--compare-cp1"], ("--nproc",))   # CP = 1 sets its own
    if args.reset_attention_mask and args.document_unit is None:
        # Packed documents are padded to 2 x CP: CP = 1 must pad the same way to see the same batches.
        world = args.nproc or int(os.environ.get("WORLD_SIZE", 1))
        cp = args.context_parallel_size or world // args.tensor_model_parallel_size
        base += ["--document-unit", str(packed_unit(args.context_parallel_algo, cp))]
    cp1 = _drop_flags(base, ("--context-parallel-size", "--log-json", "--cp-grid"))
    nproc = ["--nproc", str(args.nproc)] if args.nproc else []
    runs = {"CP=1": cp1 + ["--nproc", "1", "--context-parallel-size", "1", "--log-json", f"{tmp}/cp1.jsonl"]
            + (["--save", f"{tmp}/cp1-ckpt"] if args.save else [])     # not into this run's --save
            + (["--result-json", f"{tmp}/cp1.json"] if args.result_json else []),   # keep the user's for this run
            "this run": base + nproc + ["--log-json", f"{tmp}/cp.jsonl"]}
    for name, flags in runs.items():
        print(f"== {name}: megatron-cp-pretrain {' '.join(flags)}", flush=True)
        if subprocess.call([sys.executable, "-m", "megatron_cp_plugin.pretrain", *flags]) != 0:
            sys.exit(f"megatron-cp-pretrain: the {name} run failed")
    cp1, cp = ([json.loads(x)["loss"] for x in open(f"{tmp}/{n}.jsonl")] for n in ("cp1", "cp"))
    print(f"\n{'iteration':>9} {'loss CP=1':>12} {'loss ' + args.context_parallel_algo:>20} {'difference':>11}")
    for i, (a, b) in enumerate(zip(cp1, cp)):
        print(f"{(i + 1) * args.log_interval:>9} {a:>12.6f} {b:>20.6f} {b - a:>11.2e}")


def main(argv=None) -> None:
    """megatron-cp-pretrain."""
    from .config import launch_errors, parse_args

    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv, description=_DOC)
    errors = launch_errors(args)                       # before any rank starts: one line each, no tracebacks
    if errors:
        for line in errors:
            print(f"megatron-cp-pretrain: error: {line}", file=sys.stderr)
        sys.exit(2)
    check_world(args)
    check_memory(args)
    if args.compare_cp1 and "RANK" not in os.environ:
        compare_cp1(argv, args)
        return
    launch(args, _train)


_DOC = """GPT pretraining with context-parallel attention: `megatron-cp-pretrain` / `python -m megatron_cp_plugin.pretrain`.

    torchrun --nproc-per-node 4 -m megatron_cp_plugin.pretrain --context-parallel-size 4 \\
        --context-parallel-algo attention2d --mock-data --train-iters 20
    megatron-cp-pretrain --nproc 4 ...        # same, spawning the processes itself (no torchrun)
    megatron-cp-pretrain --config configs/gpt3-2.7b.toml configs/algo/ring.toml --seq-length 65536 ...
    megatron-cp-pretrain --config configs/gpt3-13b.toml --use-megatron-fsdp \\
        --data-parallel-sharding-strategy optim_grads_params ...   # ZeRO-3 over data-parallel x CP

--config reads TOML files whose keys are these flags' names (`num-layers = 24`, `bf16 = true`); later files
override earlier ones and the command line overrides them all. --result-json writes one JSON per run.
Megatron's flag names and code on both devices: Megatron's DDP or Megatron-FSDP over the data-parallel x CP
group and Megatron's optimizer; NCCL and bf16 (--bf16) on GPUs, gloo and fp32 without one. --save / --load
checkpoint and resume exactly (docs/training.md).
"""
