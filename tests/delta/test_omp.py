"""torch's OpenMP team as ckptdelta.delta.omp finds it, and where it must not be used."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ckptdelta.delta import omp

needs_openmp = pytest.mark.skipif("parallel backend: OpenMP" not in torch.__config__.parallel_info(),
                                  reason="this torch build runs on no OpenMP runtime")


def _mapped() -> set[str]:
    with open("/proc/self/maps") as f:
        return {os.path.realpath(p[5].strip()) for p in (line.split(None, 5) for line in f) if len(p) == 6}


@needs_openmp
def test_the_team_is_the_openmp_runtime_torch_itself_loaded():
    team = omp.team()
    assert team is not None
    here = os.path.dirname(os.path.realpath(torch.__file__))
    path = os.path.realpath(team.path)
    assert path in _mapped()
    assert path.startswith((os.path.join(here, "lib") + os.sep, here + ".libs" + os.sep))


def test_a_library_not_loaded_already_is_never_loaded_as_a_team():
    here = os.path.join(os.path.dirname(torch.__file__), "lib")
    unloaded = [os.path.join(here, n) for n in sorted(os.listdir(here))
                if ".so" in n and os.path.realpath(os.path.join(here, n)) not in _mapped()]
    assert unloaded, "every library of torch's is loaded: nothing to try"
    with pytest.raises(OSError):
        omp.Team(unloaded[0])


_CHILD = r"""
import os, sys
import numpy as np, torch
from ckptdelta.delta import omp
from ckptdelta.loader import batch_commit

torch.ones(1 << 22).add_(1)            # torch's team has run in the parent
assert omp.team() is not None
batch_commit.THREADS_ABOVE_NS = batch_commit.TEAM_ABOVE_NS = 0.0
batch_commit.TASK_ELEMS = 64             # ranges enough for two threads
rng = np.random.default_rng(0)

def batch():
    live = rng.integers(0, 1 << 16, 1 << 16, dtype=np.uint16)
    pos = np.flatnonzero(rng.random(live.shape[0]) < 0.05).astype(np.int64)
    new = live[pos] ^ np.uint16(1)
    item = batch_commit.Item("t", "t", live, pos, live[pos].copy(), new, batch_commit.choose(live, pos, new, "scatter"))
    b = batch_commit.CommitBatch([item], threads=2)
    return b, live, pos, new

b, live, pos, new = batch()
b.run()
assert b.runner == "team" and len(b.ranges) > 1 and (live[pos] == new).all()
pid = os.fork()
if pid == 0:
    b, live, pos, new = batch()
    ok = omp.team() is None and b.runner == "threads"
    b.run()
    os._exit(0 if ok and (live[pos] == new).all() else 3)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status))
"""


@needs_openmp
def test_a_process_forked_after_the_team_ran_commits_on_threads_of_its_own():
    """libgomp is not fork-safe: a child's region waits for threads that exist only in the parent (it hangs
    when the guard is taken out, as torch's own copy_ does there)."""
    r = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "child exit 0" in r.stdout


def test_ckptdelta_omp_team_0_turns_the_team_off(monkeypatch):
    monkeypatch.setenv("CKPTDELTA_OMP_TEAM", "0")
    assert omp.team() is None


@needs_openmp
def test_serial_here_runs_the_calling_threads_torch_ops_alone_and_leaves_other_threads_their_teams():
    """A thread of ours (a vLLM worker's LoRA writes) sets its own OpenMP thread count to 1: its torch ops then run
    on it alone, bit for bit as before, while the thread that started it, and a thread started later, keep
    the process's count."""
    import threading

    was = torch.get_num_threads()
    before = max(2, was)
    torch.set_num_threads(before)        # set explicitly, as vLLM's workers do: each new thread's set-up applies it
    src = torch.randn(1 << 20, dtype=torch.float32)
    want = src.to(torch.bfloat16)
    seen: dict[str, object] = {}

    def ours() -> None:
        seen["took"] = omp.serial_here()  # before torch's own per-thread set-up, which must not undo it
        seen["bits"] = torch.equal(src.to(torch.bfloat16).view(torch.int16), want.view(torch.int16))
        seen["threads"] = torch.get_num_threads()        # after a parallel op too

    def other() -> None:
        seen["other"] = torch.get_num_threads()

    try:
        for fn in (ours, other):
            t = threading.Thread(target=fn)
            t.start()
            t.join()
        assert seen == {"took": True, "threads": 1, "bits": True, "other": before}
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(was)
