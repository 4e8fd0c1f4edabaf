"""tests/conftest.py's MCP_LONG_TESTS ordering (scripts/gpu_tests.sh sets it): the listed tests are collected first,
longest first, each followed by one unlisted test; without the variable (or with it empty: the same early return)
the order is pytest's. And MCP_DONE_RUNS (gpu_tests.sh's REST): what earlier runs finished is left out."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = ["tests/test_long_first_sample.py"]


def _collect(env_extra):
    env = {k: v for k, v in os.environ.items() if k != "MCP_LONG_TESTS"} | env_extra
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *FILES],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return [ln for ln in r.stdout.splitlines() if "::" in ln]


def test_listed_tests_come_first_longest_first(tmp_path):
    plain = _collect({})
    assert len(plain) == 6
    ids = {i: plain[i] for i in range(6)}
    tsv = tmp_path / "long.tsv"
    tsv.write_text("# seconds\ttest id\n" f"20\t{ids[4]}\n" f"90\t{ids[5]}\n" f"45\t{ids[1]}\n"
                   "30\ttests/test_gone.py::test_renamed_since\n")          # a stale id is ignored
    got = _collect({"MCP_LONG_TESTS": str(tsv)})
    assert got == [ids[5], ids[0], ids[1], ids[2], ids[4], ids[3]]


def test_the_shipped_list_is_well_formed():
    """scripts/test_long.tsv: "seconds<TAB>test id" lines under its comment, longest first."""
    rows = [ln.split("\t") for ln in (ROOT / "scripts/test_long.tsv").read_text().splitlines()
            if ln and not ln.startswith("#")]
    assert rows and all(len(r) == 2 and "::" in r[1] and (ROOT / r[1].split("::")[0]).exists() for r in rows)
    secs = [float(r[0]) for r in rows]
    assert secs == sorted(secs, reverse=True) and min(secs) >= 20


def test_done_runs_leave_out_what_finished_and_keep_the_cut_and_the_failed(tmp_path):
    ids = _collect({})
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    # run a: ids 0 and 1 finished, 2 failed, 3 started and was cut; run b: 4 finished
    (a / "running.txt").write_text("".join(f"start\t1\t{ids[i]}\n" for i in range(4))
                                   + "".join(f"end\t2\t{ids[i]}\n" for i in range(3)))
    (a / "failures.txt").write_text(f"FAILED {ids[2]} (call)\n    E   assert 0\n")
    (b / "running.txt").write_text(f"start\t1\t{ids[4]}\nend\t2\t{ids[4]}\n")
    assert _collect({"MCP_DONE_RUNS": f"{a} {b}"}) == [ids[2], ids[3], ids[5]]
    assert _collect({"MCP_DONE_RUNS": str(tmp_path / "none")}) == ids        # no logs there: nothing is done


def test_rest_may_not_name_this_runs_out(tmp_path):
    r = subprocess.run(["bash", "scripts/gpu_tests.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, OUT=str(tmp_path), REST=str(tmp_path), TESTS="tests/test_none.py"))
    assert r.returncode == 2 and "REST names OUT" in r.stderr, r.stderr[-2000:]
