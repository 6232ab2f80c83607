"""benchmarks/proc_cpu.py: the CPU a process tree spent, by role, read from /proc (no timing asserted beyond
"it spent some, and it was counted under the right role")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from benchmarks import proc_cpu

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

SPIN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"
#: A child that spins 0.4 s of CPU, says so on the stdout it shares with its parent, and stays.
CHILD = SPIN.format(s=0.4) + "print('spun', flush=True)\ntime.sleep(60)\n"
#: Its parent, which spins 0.2 s first, then starts it and stays.
PARENT = "import subprocess, sys\n" + SPIN.format(s=0.2) + \
    f"subprocess.Popen([sys.executable, '-c', {CHILD!r}])\ntime.sleep(60)\n"


def _tree() -> subprocess.Popen:
    """The parent (in a session of its own, so the test ends both), once its child has spun."""
    p = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "spun"
    return p


def test_a_process_and_its_descendants_count_under_its_role():
    p = _tree()
    try:
        got = proc_cpu.cpu_by_role({"peer": p.pid, "gone": None})
        assert set(got) == {"peer"}                  # a role without a process is left out
        assert got["peer"] >= 0.5                    # 0.2 s of the parent's spin and 0.4 s of its child's
    finally:
        os.killpg(p.pid, signal.SIGKILL)           # the parent and its child
        p.wait()


def test_descendants_mapped_to_a_role_of_their_own_are_counted_there_and_not_twice():
    p = _tree()
    try:
        got = proc_cpu.cpu_by_role({"peer": p.pid}, descendants_as={"peer": "engine"})
        assert got["engine"] >= 0.35 and 0.15 <= got["peer"] < 0.35, got
        whole = proc_cpu.cpu_by_role({"peer": p.pid})["peer"]
        assert abs(whole - (got["peer"] + got["engine"])) < 0.05
    finally:
        os.killpg(p.pid, signal.SIGKILL)           # the parent and its child
        p.wait()


def test_spent_is_the_difference_of_two_readings_and_a_process_spending_nothing_adds_nothing():
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE)
    try:
        time.sleep(0.5)                               # its interpreter's start is behind it
        before = proc_cpu.cpu_by_role({"idle": p.pid})
        time.sleep(0.3)
        after = proc_cpu.cpu_by_role({"idle": p.pid})
        assert proc_cpu.spent(before, after)["idle"] < 0.05
        assert proc_cpu.spent({"idle": 1.0}, {"idle": 0.5}) == {"idle": 0.0}    # never negative
    finally:
        p.kill()
        p.wait()
