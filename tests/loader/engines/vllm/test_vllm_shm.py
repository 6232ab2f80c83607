"""vLLM's CPU all-reduce shared memory (``/dev/shm/vllm_dist_*``) goes when the VllmServer that started it stops
(loader/engines/vllm/shm.py), and nothing else does: not what was there before, not another vLLM's, not what a
live process maps or holds open. No vLLM needed: a stand-in directory for ``/dev/shm``, and a fake vLLM server
whose "worker" creates and maps its segments the way vLLM's CPU workers do (tests/loader/engines/vllm/test_vllm_tp.py checks a real
TP-2 vLLM's)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from ckptdelta.loader.engines.vllm import shm as vllm_shm

# Holds the first path open and maps the second (its descriptor closed, as vLLM's workers do), then waits.
HOLDER = """
import mmap, os, sys
held = os.open(sys.argv[1], os.O_RDWR)
fd = os.open(sys.argv[2], os.O_RDWR)
m = mmap.mmap(fd, 4096)
os.close(fd)
print("ready", flush=True)
sys.stdin.read()
"""


def _segment(d, ident: str, rank: int) -> str:
    path = os.path.join(d, f"{ident}-tp:0-[0-1]-cpushm_{rank}")
    with open(path, "wb") as f:
        f.truncate(4096)
    return os.path.basename(path)


def test_only_new_segments_of_this_vllm_that_no_live_process_maps_or_holds_open_are_removed(tmp_path):
    shm = str(tmp_path / "shm")
    os.mkdir(shm)
    stale = _segment(shm, "vllm_dist_0000", 0)                    # a dead vLLM's, there before ours started
    before = vllm_shm.segments(shm)
    held, mapped, free = (_segment(shm, "vllm_dist_aaaa", r) for r in (0, 1, 2))
    theirs = _segment(shm, "vllm_dist_bbbb", 0)                   # another vLLM's, started meanwhile
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, os.path.join(shm, held), os.path.join(shm, mapped)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        assert vllm_shm.remove_leftovers(before, own={"vllm_dist_aaaa"}, shm_dir=shm) == [free]
        assert vllm_shm.segments(shm) == {stale, held, mapped, theirs}
        # this vLLM's rendezvous unknown: any new segment no live process uses
        assert vllm_shm.remove_leftovers(before, shm_dir=shm) == [theirs]
        assert vllm_shm.segments(shm) == {stale, held, mapped}
    finally:
        holder.stdin.close()
        holder.wait(30)
    # once their last user is gone, they go too
    assert sorted(vllm_shm.remove_leftovers(before, own={"vllm_dist_aaaa"}, shm_dir=shm)) == sorted([held, mapped])
    assert vllm_shm.segments(shm) == {stale}


def test_a_segment_that_cannot_be_removed_is_left_without_an_error(tmp_path, monkeypatch):
    shm = str(tmp_path)
    locked, gone, free = (_segment(shm, "vllm_dist_aaaa", r) for r in (0, 1, 2))
    unlink = os.unlink

    def refuse(path, *a, **kw):
        name = os.path.basename(path)
        if name == locked:
            raise PermissionError(13, "Permission denied", path)
        if name == gone:
            unlink(path)        # removed by someone else first
        return unlink(path, *a, **kw)

    monkeypatch.setattr(os, "unlink", refuse)
    assert vllm_shm.remove_leftovers(set(), shm_dir=shm) == [free]


def test_the_rendezvous_files_in_vllms_private_temp_dir_name_its_segments(tmp_path):
    (tmp_path / "vllm_dist_3f2a").write_bytes(b"")
    (tmp_path / "other").write_bytes(b"")
    assert vllm_shm.idents(str(tmp_path)) == {"vllm_dist_3f2a"}
    assert vllm_shm.idents(None) == set() and vllm_shm.idents(str(tmp_path / "none")) == set()


# --- VllmServer.stop, over a fake vLLM ----------------------------------------------------------------------------

# The API server: torch.distributed's rendezvous file in its TMPDIR, as vLLM's file store makes it, and a "worker"
# in its process group that creates and maps both ranks' segments, named for that file, and ignores SIGTERM.
FAKE_SERVER = """
import os, subprocess, sys, time
ident = "vllm_dist_" + os.environ["FAKE_IDENT"]
open(os.path.join(os.environ["TMPDIR"], ident), "wb").close()
subprocess.Popen([sys.executable, "-c", os.environ["FAKE_WORKER"], ident])
if os.environ.get("FAKE_CRASH"):
    sys.exit(3)
time.sleep(600)
"""
FAKE_WORKER = """
import mmap, os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
maps = []
for rank in (0, 1):
    fd = os.open(f"/dev/shm/{sys.argv[1]}-tp:0-[0-1]-cpushm_{rank}", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 4096)
    maps.append(mmap.mmap(fd, 4096))
    os.close(fd)
time.sleep(600)
"""


def _fake_vllm(root) -> str:
    pkg = root / "fake" / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(FAKE_SERVER)
    return str(root / "fake")


@pytest.mark.skipif(not os.path.isdir(vllm_shm.SHM_DIR), reason="no /dev/shm")
@pytest.mark.parametrize("crash", [False, True], ids=["stopped", "crashed"])
def test_stop_ends_vllms_workers_and_removes_the_segments_its_vllm_created_and_only_those(tmp_path, crash):
    from ckptdelta.loader.engines.vllm.server import VllmServer

    ours, theirs = (uuid.uuid4().hex for _ in range(2))
    env = {"PYTHONPATH": _fake_vllm(tmp_path), "FAKE_IDENT": ours, "FAKE_WORKER": FAKE_WORKER,
           **({"FAKE_CRASH": "1"} if crash else {})}
    server = VllmServer(str(tmp_path), served_name="fake", env=env)
    mine = {f"vllm_dist_{ours}-tp:0-[0-1]-cpushm_{r}" for r in (0, 1)}
    other = f"/dev/shm/vllm_dist_{theirs}-tp:0-[0-1]-cpushm_0"   # another replica's, created meanwhile: not ours
    try:
        deadline = time.monotonic() + 60
        while not mine <= vllm_shm.segments() or (crash and server.proc.poll() is None):
            assert time.monotonic() < deadline, server.tail()
            time.sleep(0.05)
        with open(other, "wb") as f:
            f.truncate(4096)
        worker = [p for p in vllm_shm.live_members(server.proc.pid) if p != server.proc.pid]
        assert len(worker) == 1
        t0 = time.monotonic()
        server.stop(timeout=1.0, keep_log=False)
        assert time.monotonic() - t0 < 15
        assert vllm_shm.live_members(server.proc.pid) == []       # the worker that ignored SIGTERM too
        assert not mine & vllm_shm.segments() and os.path.exists(other)
        server.stop()                                              # idempotent
        assert os.path.exists(other)
    finally:
        for p in vllm_shm.live_members(server.proc.pid):
            os.kill(p, 9)
        for name in mine | {os.path.basename(other)}:
            try:
                os.unlink(os.path.join(vllm_shm.SHM_DIR, name))
            except FileNotFoundError:
                pass
