"""``ckptdelta warmup`` (run by make at install) compiles every codec path on the real code, bit-exact."""

from __future__ import annotations

import os
import subprocess
import sys

import torch


def test_ckptdelta_warmup_runs_every_dtype_and_codec_path_bit_exact_and_marks_the_environment_warm():
    from ckptdelta.delta import kernel_cache

    r = subprocess.run([sys.executable, "-m", "ckptdelta", "warmup"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "codec kernels ready" in r.stderr and kernel_cache.kernel_dir() in r.stderr
    assert "[1/" not in r.stderr, "per-group progress is for a terminal (--progress)"
    assert kernel_cache.is_warm()       # this process's environment and sources: no announcement of a compile


_WARMUP_ON = {**os.environ, "CKPTDELTA_WARMUP": "1"}     # the suite turns it off (tests/conftest.py)

_REPLICA = r"""
import sys, torch
from ckptdelta.delta import warmup
from ckptdelta.loader import HotSwapper, SnapshotReader
from ckptdelta.publisher import Publisher

run, mode = sys.argv[1], sys.argv[2]
old = {"w": torch.randn(4096).to(torch.bfloat16), "norm": torch.randn(64)}
new = {"w": old["w"].clone(), "norm": old["norm"].clone()}
new["w"][::50] = new["w"][::50] * 1.01
with Publisher(run, progress=False) as pub:
    pub.publish(old, 0)
    pub.publish(new, 1)
if mode == "broken":
    def broken(*a):
        raise RuntimeError("no")
    warmup._warm_stage = broken
assert warmup.wait_warm(0) == set(), "nothing warms before a hot-swapper is built"
live = {k: v.clone() for k, v in old.items()}
swapper = HotSwapper(live, SnapshotReader(run), version=0)
print("running after construction:", warmup._thread is not None and warmup._thread.is_alive())
if mode == "hot-load at once":
    prepared = swapper.prepare(1)     # the stage paths left are dropped, the commit's warmed before the pause
    print("warm before the pause:", sorted(map(str, warmup.wait_warm(0))))
    from ckptdelta.delta import commit_ranges
    before = len(commit_ranges.commit_ranges.overloads) + len(commit_ranges.undo_ranges.overloads)
    team_loaded = "ckptdelta.delta.commit_team" in sys.modules
    swapper.commit(prepared)
    after = len(commit_ranges.commit_ranges.overloads) + len(commit_ranges.undo_ranges.overloads)
    print("commit kernels loaded in the pause:", after - before + ("ckptdelta.delta.commit_team" in sys.modules) - team_loaded)
else:
    warmup.wait_warm(300)
    swapper.commit(swapper.prepare(1))
assert all(torch.equal(live[k].view(torch.uint8), new[k].view(torch.uint8)) for k in new)
print("warmed:", sorted(map(str, warmup.wait_warm(300))))
print("failed:", sorted(map(str, warmup.failed())))
"""


def _replica(tmp_path, mode: str) -> list[str]:
    r = subprocess.run([sys.executable, "-c", _REPLICA, str(tmp_path / "run"), mode], capture_output=True,
                       text=True, timeout=600, env=_WARMUP_ON)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()


_ALL = sorted(map(str, [("commit", 2), ("commit", 4), ("stage", torch.bfloat16, True),
                        ("stage", torch.bfloat16, False), ("stage", torch.float32, True),
                        ("stage", torch.float32, False)]))


def test_a_hot_swapper_warms_the_staging_and_commit_paths_of_its_dtypes_in_the_background(tmp_path):
    out = _replica(tmp_path, "wait")
    assert out[0] == "running after construction: True"      # construction did not wait for it
    assert out[-2] == f"warmed: {_ALL}" and out[-1] == "failed: []"


def test_a_hot_load_right_after_start_drops_the_staging_paths_but_warms_the_commit_before_its_pause(tmp_path):
    out = _replica(tmp_path, "hot-load at once")
    before_pause = next(line for line in out if line.startswith("warm before the pause:"))
    assert "('commit', 2)" in before_pause          # the bf16 tensor's commit: compiled in prepare, not the pause
    assert "commit kernels loaded in the pause: 0" in out   # the warmed types are the ones the pause passes
    assert out[-1] == "failed: []"


def test_a_warm_up_that_fails_is_logged_and_not_reported_as_warm(tmp_path):
    out = _replica(tmp_path, "broken")
    warmed, failed = out[-2], out[-1]
    assert "stage" not in warmed and "('commit', 2)" in warmed
    assert failed == "failed: " + str([x for x in _ALL if "stage" in x])


_FORK = r"""
import os, sys, time, torch
from ckptdelta.delta import encode, stage, warmup
from ckptdelta.loader import HotSwapper, SnapshotReader
from ckptdelta.publisher import Publisher

run = sys.argv[1]
with Publisher(run, progress=False) as pub:
    pub.publish({"w": torch.randn(1024).to(torch.bfloat16)}, 0)
HotSwapper({"w": torch.zeros(1024, dtype=torch.bfloat16), "h": torch.zeros(8, dtype=torch.float16)},
           SnapshotReader(run), version=0)
time.sleep(0.05)            # the warm-up is under way, inside numba's compiler lock most of the time
pid = os.fork()
if pid == 0:                # the child compiles and loads kernels of its own
    old = torch.randn(4096)    # float32: cached at install, loaded here
    new = old.clone(); new[::5] += 1.0
    live = old.clone()
    stage(live, encode(old, new, name="c").to_bytes()).apply_(live)
    os._exit(0 if torch.equal(live, new) else 3)
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print("child exit", os.waitstatus_to_exitcode(status))
        break
    time.sleep(0.1)
else:
    os.kill(pid, 9)
    print("child hung")
warmup.wait_warm(300)
"""


def test_a_process_forked_while_the_warm_up_runs_can_compile_kernels_of_its_own(tmp_path):
    r = subprocess.run([sys.executable, "-c", _FORK, str(tmp_path / "run")], capture_output=True, text=True,
                       timeout=600, env=_WARMUP_ON)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "child exit 0", r.stdout


def test_the_warm_up_stays_off_when_the_environment_says_so(monkeypatch):
    from ckptdelta.delta import warmup

    monkeypatch.setenv("CKPTDELTA_WARMUP", "0")
    assert warmup.warm_in_background([torch.bfloat16]) is None
