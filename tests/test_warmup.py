"""``python -m delta.warmup`` (run by make at install) compiles every codec path on the real code, bit-exact."""

from __future__ import annotations

import subprocess
import sys


def test_the_warm_up_runs_every_dtype_and_codec_path_bit_exact_in_a_fresh_process():
    r = subprocess.run([sys.executable, "-m", "delta.warmup"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "codec kernels ready" in r.stderr


_REPLICA = r"""
import sys, torch
from delta import warmup
from loader import HotSwapper, SnapshotReader
from publisher import Publisher

run = sys.argv[1]
old = {"w": torch.randn(4096).to(torch.bfloat16), "norm": torch.randn(64)}
new = {"w": old["w"].clone(), "norm": old["norm"].clone()}
new["w"][::7] = new["w"][::7] * 1.01
with Publisher(run, progress=False) as pub:
    pub.publish(old, 0)
    pub.publish(new, 1)
assert warmup.wait_warm(0) == set(), "nothing warms before a hot-swapper is built"
live = {k: v.clone() for k, v in old.items()}
swapper = HotSwapper(live, SnapshotReader(run), version=0)
warmed = warmup.wait_warm(300)
swapper.commit(swapper.prepare(1))
assert all(torch.equal(live[k].view(torch.uint8), new[k].view(torch.uint8)) for k in new)
print(sorted((kind, str(what)) for kind, what in warmed))
"""


def test_a_hot_swapper_warms_the_staging_and_commit_paths_of_its_dtypes_in_the_background(tmp_path):
    r = subprocess.run([sys.executable, "-c", _REPLICA, str(tmp_path / "run")], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == str(sorted([("commit", "2"), ("commit", "4"),
                                                             ("stage", "torch.bfloat16"), ("stage", "torch.float32")]))


_FORK = r"""
import os, sys, time, torch
from delta import encode, stage, warmup
from loader import HotSwapper, SnapshotReader
from publisher import Publisher

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
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "child exit 0", r.stdout
