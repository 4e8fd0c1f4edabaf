"""Watching spawned ranks (--nproc): a rank that dies, freezes or is left behind must end the job, promptly,
with one line naming it, and leave no process behind.

Each spawned rank runs a daemon thread (`guard_rank`) that writes the time into its slot of a shared array
every BEAT_S seconds. The thread beats whatever the rank's main thread is doing (computing, saving, blocked in
a gloo or NCCL collective, which release the GIL), so a stale slot means the whole process is frozen (SIGSTOP,
a stopped debugger, swapped out): the same test on every backend. The launching process (`supervise`) polls
the ranks: a rank that exits non-zero, or whose heartbeat is older than --dist-timeout, ends the job, as do
SIGINT / SIGTERM / SIGHUP to the launcher. Ending the job means SIGKILL to every descendant of the launcher
(the ranks and what they started, e.g. dist_checkpointing's writer forks and Manager process, kept in the tree by
PR_SET_CHILD_SUBREAPER even when the rank that forked them died first) except multiprocessing's
resource trackers, which exit by themselves once the processes holding their pipe are gone and then free
whatever those registered. SIGKILL, not SIGTERM: a stopped process or one blocked in a collective would not
act on SIGTERM, and a checkpoint save cut short is harmless because the tracker file is written only after
a complete save (training/checkpoint.py). A rank whose launcher dies (kill -9) is woken by the kernel
(PR_SET_PDEATHSIG, SIGCONT), and its guard thread kills what the rank started and ends it.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

BEAT_S = 0.5          # heartbeat period of a rank's guard thread
POLL_S = 0.2          # the launcher's polling period
START_S = 120.0       # a rank gets at least this long to import torch and start beating (busy machines)
EXIT_WAIT_S = 5.0
"""How long a rank's failure (an exit status) waits to be named while a peer is already exiting, unreaped: the
peer may be the cause (killed) and the failure its consequence. On one H200 (2026-11-29, gpu_tests.sh) a rank
SIGKILLed during a save was still unreaped, freeing its GPU context, when its peer's gloo broadcast had failed on
the closed socket and the peer had exited with status 1: the job was blamed on the peer."""
PF_EXITING = 0x4      # /proc/<pid>/stat flags: the process is in exit (its files closed, or being closed)


def guard_rank(beats, rank: int, parent: int) -> None:
    """In a spawned rank, first thing: die with the launcher, leave SIGINT to it, and beat every BEAT_S."""
    # When the launcher dies the kernel sends SIGCONT (PR_SET_PDEATHSIG), which wakes a stopped rank; its
    # heartbeat thread then kills the rank's process group: the rank and what it started (dist_checkpointing's
    # writer forks and the Manager process it spawns), which SIGKILL as parent-death signal would orphan.
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGCONT))      # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):             # not Linux: the thread below still notices, within BEAT_S
        pass
    # SIGINT is the launcher's to handle (it ends the job), so ranks print no tracebacks. A process group of
    # its own keeps the terminal's Ctrl-C and Ctrl-Z from the rank (the launcher acts for it) and gathers what
    # the rank starts, so that one killpg ends them all, even a process the rank's main thread is starting at
    # that moment (the kernel lets no fork escape a group kill).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.setpgid(0, 0)
        own_group = True
    except OSError:
        own_group = False

    def beat() -> None:
        while True:
            beats[rank] = time.monotonic()       # CLOCK_MONOTONIC: one clock for every process of the host
            if os.getppid() != parent:           # the launcher died
                if own_group:
                    os.killpg(0, signal.SIGKILL)  # this rank too
                kill_own_helpers()
                os._exit(1)
            time.sleep(BEAT_S)

    beats[rank] = time.monotonic()
    threading.Thread(target=beat, name="megatron-cp-heartbeat", daemon=True).start()


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    if not os.path.isdir("/proc"):                # not Linux: only the ranks themselves are killed
        return kids
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(name))
    return kids


def descendants(pid: int) -> list[int]:
    """Every live descendant of pid (children first), from /proc."""
    kids, out, todo = _children(), [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def state(pid: int) -> str:
    """The process state letter of /proc/<pid>/stat ('R', 'S', 'T' stopped, 'Z', ...); '?' if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def dying(pid: int) -> str | None:
    """"SIGKILL" where a SIGKILL is pending for pid (it dies by it, once out of an uninterruptible wait such as a
    checkpoint writer's fsync), "exiting" where it is in exit already (PF_EXITING: a process that held a GPU context
    can take seconds there, its sockets closed first), else None (alive, gone, or not Linux)."""
    kill_bit = 1 << (signal.SIGKILL - 1)
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & kill_bit:
                    return "SIGKILL"
        with open(f"/proc/{pid}/stat") as f:
            flags = int(f.read().rsplit(")", 1)[1].split()[6])
    except (OSError, IndexError, ValueError):
        return None
    return "exiting" if flags & PF_EXITING else None


def adopt_orphans() -> None:
    """Make this process the reaper of its descendants' orphans (PR_SET_CHILD_SUBREAPER): a process a rank
    forked (a checkpoint writer) whose rank dies stays our descendant, so kill_descendants still finds it."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(36, 1)      # PR_SET_CHILD_SUBREAPER = 36
    except (OSError, AttributeError):
        pass


def _descendants_but_trackers(pid: int) -> list[int]:
    return [p for p in descendants(pid) if "resource_tracker" not in _cmdline(p)]


def kill_own_helpers() -> None:
    """SIGKILL what this process started (a rank's checkpoint writers, Manager process), before it exits
    abnormally: os._exit runs no finalizer that would shut them down."""
    _kill(_descendants_but_trackers(os.getpid()))


def _kill(pids) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_descendants(procs) -> None:
    """SIGKILL every descendant of this process but the resource trackers, then reap them."""
    ranks = {p.pid for p in procs}
    for _ in range(5):                            # one forked or adopted while we collected: sweep again
        pids = _descendants_but_trackers(os.getpid()) + [p.pid for p in procs if p.exitcode is None]
        if not pids:
            break
        _kill(pids)
        for p in procs:
            p.join(timeout=5)
        for p in set(pids) - ranks:                # adopted orphans are our children now: no zombies
            try:
                os.waitpid(p, os.WNOHANG)
            except ChildProcessError:
                pass


def _why(rank: int, proc, since: float, now: float, timeout: float) -> str:
    age = now - since
    st = state(proc.pid)
    words = {"T": "stopped", "t": "stopped by a tracer", "D": "in uninterruptible I/O", "Z": "exited"}.get(st, st)
    return (f"rank {rank} (pid {proc.pid}) is frozen: no heartbeat for {age:.1f} s (--dist-timeout {timeout:g} s, "
            f"process state: {words})")


def supervise(procs, beats, timeout: float, prog: str) -> int:
    """Watch the started ranks until all exit 0 (returns 0) or the job must end (kills everything, returns the
    exit status after printing one line naming the cause)."""
    interrupted: list[int] = []

    def on_signal(signum, _frame):
        interrupted.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    start = last = time.monotonic()
    first_failure, seen_failed = 0.0, []       # ranks in the order their failures were seen
    try:
        while True:
            time.sleep(POLL_S)
            now = time.monotonic()
            if now - last > POLL_S + 2.0:         # this process was stopped too (Ctrl-Z, fg): so were the ranks
                for r in range(len(procs)):
                    beats[r] = max(beats[r], now)
            last = now
            cause, status = None, 1
            if interrupted:
                cause, status = f"interrupted by {signal.Signals(interrupted[0]).name}", 128 + interrupted[0]
            codes = [p.exitcode for p in procs]
            if cause is None and all(c == 0 for c in codes):
                return 0
            seen_failed += [r for r, c in enumerate(codes) if c not in (None, 0) and r not in seen_failed]
            failed = list(seen_failed)
            stale = [r for r, p in enumerate(procs) if codes[r] is None and (
                     now - max(beats[r], start) > (timeout if beats[r] else max(timeout, START_S)))]
            if cause is None and failed:
                # A peer's collective may time out first, or fail on the socket of a rank being killed: a frozen
                # rank (beat missing for longer than a loaded machine delays a live one's, or stopped) is the
                # cause, then a killed one (reaped, or SIGKILL pending), then one in exit (waited for up to
                # EXIT_WAIT_S, to be reaped and named with its signal), then the first seen to fail.
                first_failure = first_failure or now
                ending = {r: dying(p.pid) for r, p in enumerate(procs) if codes[r] is None}
                frozen = [r for r, p in enumerate(procs) if codes[r] is None and beats[r] and not ending[r]
                          and (now - beats[r] > max(4 * BEAT_S, min(5.0, timeout / 2)) or state(p.pid) in "Tt")]
                killed = [r for r in failed if codes[r] < 0]
                pending = [r for r, why in ending.items() if why == "SIGKILL"]
                if frozen:
                    cause = _why(frozen[0], procs[frozen[0]], beats[frozen[0]], now, timeout)
                elif killed:
                    r = killed[0]
                    name = signal.Signals(-codes[r]).name if -codes[r] in signal.valid_signals() else -codes[r]
                    cause = f"rank {r} (pid {procs[r].pid}) was killed by {name}"
                elif pending:
                    cause = f"rank {pending[0]} (pid {procs[pending[0]].pid}) was killed by SIGKILL"
                elif any(ending.values()) and now - first_failure < EXIT_WAIT_S:
                    continue
                else:
                    cause = f"rank {failed[0]} (pid {procs[failed[0]].pid}) failed with exit status {codes[failed[0]]}"
            elif cause is None and stale:
                cause = _why(stale[0], procs[stale[0]], max(beats[stale[0]], start), now, timeout)
            if cause is not None:
                kill_descendants(procs)
                print(f"{prog}: {cause}; stopped every rank", file=sys.stderr, flush=True)
                return status
    except BaseException:
        kill_descendants(procs)
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)
