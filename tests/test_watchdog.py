"""The launcher's watchdog (`training.watchdog.supervise`) naming the cause when ranks end in a race: a rank killed
while its peer's collective fails on the closed socket. test_faults.py runs the real jobs; here the ranks are
stand-ins whose exit codes and /proc view are scripted, so each order of events is tested every time."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_cp_plugin.training import watchdog


class _Rank:
    """A spawned rank as supervise sees it: a pid, and the exit codes its successive polls read (the last one
    repeats)."""

    def __init__(self, pid: int, *codes):
        self.pid, self._codes = pid, list(codes)

    @property
    def exitcode(self):
        return self._codes.pop(0) if len(self._codes) > 1 else self._codes[0]


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(watchdog, "POLL_S", 0.01)
    monkeypatch.setattr(watchdog, "kill_descendants", lambda procs: None)


def _supervise(ranks, capsys) -> tuple[int, str]:
    beats = [time.monotonic()] * len(ranks)
    status = watchdog.supervise(ranks, beats, 30.0, "prog")
    return status, capsys.readouterr().err


def test_a_rank_with_sigkill_pending_is_the_cause_not_the_peer_that_failed_on_it(fast, monkeypatch, capsys):
    # Rank 0 was sent SIGKILL inside a checkpoint's fsync (uninterruptible: not dead yet); rank 1's broadcast then
    # failed on the closed socket and rank 1 exited 1.
    monkeypatch.setattr(watchdog, "dying", lambda pid: "SIGKILL" if pid == 1001 else None)
    status, err = _supervise([_Rank(1001, None), _Rank(1002, 1)], capsys)
    assert status == 1
    assert err.strip() == "prog: rank 0 (pid 1001) was killed by SIGKILL; stopped every rank", err


def test_a_rank_in_exit_is_waited_for_and_named_with_its_signal(fast, monkeypatch, capsys):
    # Rank 0 killed, in exit (freeing a GPU context), reaped three polls after rank 1's exit status was seen.
    rank0 = _Rank(1001, None, None, None, -signal.SIGKILL)
    monkeypatch.setattr(watchdog, "dying", lambda pid: "exiting" if pid == 1001 else None)   # asked while unreaped
    status, err = _supervise([rank0, _Rank(1002, 1)], capsys)
    assert status == 1
    assert "rank 0 (pid 1001) was killed by SIGKILL" in err, err


def test_a_rank_that_stays_in_exit_delays_the_failure_by_at_most_exit_wait_s(fast, monkeypatch, capsys):
    monkeypatch.setattr(watchdog, "EXIT_WAIT_S", 0.3)
    monkeypatch.setattr(watchdog, "dying", lambda pid: "exiting" if pid == 1001 else None)
    t0 = time.monotonic()
    status, err = _supervise([_Rank(1001, None), _Rank(1002, 1)], capsys)
    assert status == 1 and time.monotonic() - t0 < 2.0
    assert "rank 1 (pid 1002) failed with exit status 1" in err, err


def test_the_first_rank_seen_to_fail_is_named_not_the_lowest(fast, monkeypatch, capsys):
    # Rank 1 fails first; rank 0, in exit meanwhile, is reaped with a status of its own (a consequence).
    rank0 = _Rank(1001, None, None, 1)
    monkeypatch.setattr(watchdog, "dying", lambda pid: "exiting" if pid == 1001 else None)
    status, err = _supervise([rank0, _Rank(1002, 3)], capsys)
    assert "rank 1 (pid 1002) failed with exit status 3" in err, err


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux /proc")
def test_dying_reads_proc():
    assert watchdog.dying(os.getpid()) is None
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(p.pid, signal.SIGSTOP)
        assert watchdog.dying(p.pid) is None                 # stopped is not dying: the frozen check names it
    finally:
        p.kill()
        p.wait()
    assert watchdog.dying(p.pid) is None                     # reaped: gone
