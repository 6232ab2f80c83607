"""A replica cleans up after itself and never removes a live neighbour's files.

Real processes and real signals: ``ckptdelta serve`` subprocesses (the reference
engine, and vLLM's CPU build) stopped by SIGTERM while serving and while
starting, killed -9 and swept by the next replica; lock owners in another PID
namespace (``unshare``, as root); a ``/dev/shm`` smaller than the model (a tmpfs
mounted in a mount namespace of its own).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import psutil
import pytest

from ckptdelta.delta import scratch
from ckptdelta.loader.cache import MAX_GB_ENV, DiskCache, default_max_bytes
from tests.replicas import PROMPT, lm_dir, publish_run, run  # noqa: F401
from tests.vllm_replicas import ONE_GPU_LAYOUT_ENV, VLLM_ARGS, publish_vllm_run
from tests import REPO

ROOT = REPO
SHM = "/dev/shm"


def _can(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_namespaces = pytest.mark.skipif(
    not (shutil.which("unshare") and _can(["unshare", "-m", "-p", "-f", "sh", "-c",
                                           "mount -t tmpfs -o size=64k tmpfs /mnt && umount /mnt"])),
    reason="needs root and unshare (mount and PID namespaces), as on CI")


@pytest.fixture
def short_tmp():
    """A temp dir of its own, with a short path (vLLM's Unix socket lives under it: paths max 107 bytes)."""
    d = tempfile.mkdtemp(prefix="ckd-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _theirs(directory: str, pid: int) -> list[str]:
    """What process ``pid`` made in ``directory`` (delta/scratch.py's names carry the owner's pid)."""
    try:
        return sorted(n for n in os.listdir(directory) if n.startswith("ckptdelta-") and f"-{pid}-" in n)
    except FileNotFoundError:
        return []


# --- ownership by lock ------------------------------------------------------------------------------

OWNER = """
import os, sys
from ckptdelta.delta import scratch
d, dead = sys.argv[1], sys.argv[2]
items = [scratch.make("weights", d), scratch.make("vllm", d)]
open(items[0].path + ".json", "w").write("{}")
open(os.path.join(items[1].path, "model.safetensors"), "w").write("x")
for o in items:   # the pid in a name says nothing: give them one that is dead in the sweeper's namespace
    new = o.path.replace(f"-{os.getpid()}-", f"-{dead}-")
    if o.path.endswith(".bin"):
        os.rename(o.path + ".json", new + ".json")
    os.rename(o.path, new)
print(os.getpid(), flush=True)
sys.stdin.read()   # hold the locks until the test closes our stdin, or kills us
"""


@needs_namespaces
def test_a_live_owner_in_another_pid_namespace_keeps_its_files_and_a_dead_owners_are_swept(tmp_path):
    d = str(tmp_path)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)
    assert not os.path.exists(f"/proc/{dead}")  # the pid every name now carries is no process here
    owner = subprocess.Popen(["unshare", "-p", "-f", "--kill-child", sys.executable, "-c", OWNER, d, str(dead)],
                             cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "1"      # pid 1 of a PID namespace of its own
        files = sorted(os.listdir(d))
        assert len(files) == 3 and all(f"-{dead}-" in f for f in files), files
        assert scratch.sweep(d) == [] and sorted(os.listdir(d)) == files     # alive: kept
        assert scratch.sweep_host(d) == [] and sorted(os.listdir(d)) == files
    finally:
        inner = psutil.Process(owner.pid).children()    # the owner, seen from here under another pid
        owner.kill()                                    # unshare --kill-child: its child is killed -9 too
        owner.wait()
        psutil.wait_procs(inner, timeout=30)
    assert sorted(scratch.sweep(d)) == files and os.listdir(d) == []      # dead: swept, siblings too


def test_dead_replicas_logs_are_kept_newest_first_and_live_ones_untouched(tmp_path):
    d = str(tmp_path)
    logs = []
    for i in range(scratch.KEEP_LOGS + 2):
        o = scratch.make("vllm-log", d)
        os.utime(o.path, (1000 + i, 1000 + i))
        o.disown()                   # what a crashed start leaves
        logs.append(os.path.basename(o.path))
    live = scratch.make("vllm-log", d)
    os.utime(live.path, (1, 1))      # the oldest, but its owner lives
    assert sorted(scratch.sweep(d)) == sorted(logs[:2])
    assert sorted(os.listdir(d)) == sorted(logs[2:] + [os.path.basename(live.path)])
    live.release()
    assert sorted(os.listdir(d)) == sorted(logs[2:])


def test_a_sweep_leaves_other_names_symlinks_and_half_made_items_alone(tmp_path):
    d = str(tmp_path)
    target = tmp_path / "precious"
    target.mkdir()
    (target / "f").write_text("keep")
    for name in ("ckptdelta-vllm-bench-abc", "ckptdelta-demo-x", "other.bin", "ckptdelta-vllm-12-0a0b0c0d.txt"):
        (tmp_path / name).write_text("x")
    os.symlink(target, tmp_path / "ckptdelta-vllm-12-deadbeef")              # a link is never followed
    (tmp_path / "ckptdelta-weights-12-deadbeef.bin").mkdir()                # the wrong type for its kind
    (tmp_path / "ckptdelta-weights-12-0badcafe.bin.json").write_text("{}")  # a sibling whose item is gone
    assert scratch.sweep(d) == ["ckptdelta-weights-12-0badcafe.bin.json"]
    assert (target / "f").read_text() == "keep"
    assert len(os.listdir(d)) == 7


def test_a_directory_swept_between_its_creation_and_its_lock_is_made_again_under_another_name(tmp_path, monkeypatch):
    """A sweep (another Publisher or replica starting on the host, or in the same process) can find a directory
    ``scratch.make`` has created and not locked yet, and remove it: make takes another name instead of failing
    (a publish failed on it with FileNotFoundError naming its temp dir)."""
    d = str(tmp_path)
    real_mkdir, swept = os.mkdir, []

    def mkdir_then_a_sweep(path, mode=0o777):
        real_mkdir(path, mode)
        if not swept:
            swept.extend(scratch.sweep(d))        # the new directory is nobody's yet: this sweep removes it
    monkeypatch.setattr(scratch.os, "mkdir", mkdir_then_a_sweep)
    owned = scratch.make("delta", d)
    monkeypatch.undo()
    assert len(swept) == 1 and swept[0] != os.path.basename(owned.path) and os.path.isdir(owned.path)
    assert scratch.sweep(d) == [] and os.listdir(d) == [os.path.basename(owned.path)]   # locked: kept
    owned.release()
    assert os.listdir(d) == []


# --- /dev/shm smaller than the model ----------------------------------------------------------------

@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    from tests.vllm_models import save_tiny_llama

    root = tmp_path_factory.mktemp("hygiene-llama")
    r = publish_vllm_run(str(root / "bucket" / "run"), save_tiny_llama(str(root / "model")), deltas=1)
    yield r
    r.publisher.close()


def _host_copy_bytes(url: str, version: int) -> int:
    from ckptdelta.loader.engines.shared_weights import ALIGN
    from ckptdelta.loader.reader import SnapshotReader

    m = SnapshotReader(url).manifest(version)
    return sum(-(-max(e.nbytes, 1) // ALIGN) * ALIGN for e in m.tensors.values())


@needs_namespaces
def test_a_dev_shm_smaller_than_the_model_fails_in_one_line_and_leaves_nothing(vllm_run, short_tmp):
    need = _host_copy_bytes(vllm_run.url, 1)
    size_kib = need // 2048                      # half the model
    ckptdelta = os.path.join(os.path.dirname(sys.executable), "ckptdelta")
    script = (f"mount -t tmpfs -o size={size_kib}k tmpfs {SHM} || exit 99; "
              f"{ckptdelta} serve --engine vllm --bucket {vllm_run.url} --port 0; echo \"rc=$?\"; ls -A {SHM}")
    out = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TMPDIR": short_tmp})
    assert out.returncode == 0, out
    lines = [line for line in out.stderr.strip().splitlines() if " INFO " not in line]   # start-up news
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr   # one line, no traceback, no SIGBUS
    mib = f"{need / (1 << 20):,.1f} MiB"
    assert lines[0].startswith("ckptdelta serve: error: the host copy of the weights needs "), lines[0]
    assert mib in lines[0] and f"free of {size_kib / 1024:,.1f} MiB" in lines[0], lines[0]
    assert "--shm-size" in lines[0] and "CKPTDELTA_SHM_DIR" in lines[0]
    assert out.stdout.strip() == "rc=1", out.stdout          # and nothing in /dev/shm after it
    assert os.listdir(short_tmp) == []                          # the scratch model copy went too


# --- the disk cache's bound -----------------------------------------------------------------------

def test_the_disk_cache_is_bounded_by_default_and_evicts_the_least_recently_used(tmp_path, monkeypatch):
    monkeypatch.delenv(MAX_GB_ENV, raising=False)
    st = os.statvfs(tmp_path)
    assert DiskCache(str(tmp_path / "c0")).max_bytes == default_max_bytes(str(tmp_path)) == max(
        1 << 30, min(32 << 30, st.f_blocks * st.f_frsize // 4))
    assert DiskCache(str(tmp_path / "c0"), max_bytes=None).max_bytes is None     # asked for no bound
    monkeypatch.setenv(MAX_GB_ENV, "0")
    assert DiskCache(str(tmp_path / "c0")).max_bytes is None
    monkeypatch.setenv(MAX_GB_ENV, str(30_000 / (1 << 30)))   # ~30 kB: room for about seven 4 kB entries
    c = DiskCache(str(tmp_path / "c"))
    live = scratch.make("vllm", c.root)                         # a live replica's model copy in the cache dir
    open(os.path.join(live.path, "model.safetensors"), "wb").write(b"\0" * 100_000)
    keys = [(f"{i:016x}", 4096, 0, 4096) for i in range(12)]
    for i, k in enumerate(keys):
        c.put(*k, bytes([i]) * 4096)
        if i >= 1:
            assert c.get(*keys[0]) == bytes([0]) * 4096     # the first entry stays hot
        time.sleep(0.01)                                     # distinct mtimes
    c.prune()
    kept = {os.path.basename(p).split("-")[0] for p, _s, _m in c.entries()}
    assert c.size_bytes() <= c.max_bytes and f"{0:016x}" in kept and f"{1:016x}" not in kept, kept
    assert f"{11:016x}" in kept
    assert os.path.getsize(os.path.join(live.path, "model.safetensors")) == 100_000     # never evicted
    live.release()


def test_serve_cache_max_gb_bounds_the_cache_and_its_start_prunes_it(tmp_path, monkeypatch):
    import argparse

    from ckptdelta.cli import serve as cli

    # unset for the code (empty is no bound given), and deleted again after the test: _sweep_host sets it in
    # this process's environment, where every later test's DiskCache would take it up (delenv of an unset
    # name restores nothing)
    monkeypatch.setenv(MAX_GB_ENV, "")
    cache = str(tmp_path / "cache")
    c = DiskCache(cache, max_bytes=None)
    for i in range(8):
        c.put(f"{i:016x}", 4096, 0, 4096, b"x" * 4096)
    parser = argparse.ArgumentParser(prog="ckptdelta")
    cli.add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--bucket", "unused", "--cache-dir", cache,
                              "--cache-max-gb", str(10_000 / (1 << 30))])
    cli._sweep_host(args)
    assert os.environ[MAX_GB_ENV] and 0 < DiskCache(cache).size_bytes() <= 10_000


# --- SIGTERM on the reference engine: drain, cut what hangs, exit 0 --------------------------------------

def _serve(args: list[str], tmp: str, log_path: str) -> tuple[subprocess.Popen, int]:
    """``ckptdelta serve ARGS --port 0``; returns the process and the port its log line names."""
    env = {**os.environ, "TMPDIR": tmp, **ONE_GPU_LAYOUT_ENV}
    proc = subprocess.Popen([sys.executable, "-m", "ckptdelta", "-v", "serve", *args, "--port", "0"], cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=open(log_path, "wb"))
    return proc, _serving_port(proc, log_path)


def _serving_port(proc: subprocess.Popen, log_path: str) -> int:
    """The port a starting ``serve --port 0`` names in its log, once it accepts connections there."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        text = open(log_path, errors="replace").read()
        if "serving policy version" in text:   # logged just before it listens
            port = int(text.split("serving policy version")[1].split("http://127.0.0.1:")[1].split()[0])
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
                return port
            except ConnectionRefusedError:
                pass
        assert proc.poll() is None, text[-3000:]
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("serve did not come up")


def _half_sent(port: int, body: dict) -> tuple[socket.socket, bytes]:
    """A completion request whose headers and part of its body are sent: in flight, held by the client."""
    raw = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=120)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: replica\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(raw) + raw[:5])
    return s, raw[5:]


def _health(port: int) -> None:
    """GET /health on a connection opened after the half-sent ones: its answer comes after the server read them
    (it accepts and reads connections in the order they arrive)."""
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=60).status_code == 200


def _response(s: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        out += chunk
    s.close()
    return out


def _wait_until_refused(port: int, proc: subprocess.Popen) -> None:
    """Until the replica no longer accepts connections: it has begun to stop."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        except ConnectionRefusedError:
            return
        assert proc.poll() is None, "the replica exited before the request in flight was answered"
        time.sleep(0.05)
    raise AssertionError("the replica kept accepting connections after SIGTERM")


def test_sigterm_finishes_the_request_in_flight_cuts_one_that_hangs_and_exits_0(run, short_tmp, tmp_path):
    log_path = str(tmp_path / "serve.log")
    proc, port = _serve(["--bucket", run.url, "--drain-timeout", "3"], short_tmp, log_path)
    try:
        finishing, rest = _half_sent(port, {"prompt": PROMPT, "max_tokens": 4, "return_engine_data": True})
        hanging, _never = _half_sent(port, {"prompt": PROMPT, "max_tokens": 4})
        _health(port)      # answered after both were read: they are in flight, from the server's point of view
        proc.send_signal(signal.SIGTERM)
        _wait_until_refused(port, proc)           # new connections refused while the two are in flight
        finishing.sendall(rest)
        answer = _response(finishing)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:500]
        body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
        assert body["engine_data"]["policy_version"] == run.latest and body["choices"][0]["text"] is not None
        assert proc.wait(120) == 0, open(log_path).read()[-3000:]      # the hanging one was cut at 3 s
        cut = _response(hanging)
        assert cut.startswith(b"HTTP/1.1 503"), cut[:500]
        assert json.loads(cut.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "replica_stopping"
        assert "Traceback" not in open(log_path).read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert os.listdir(short_tmp) == []


# --- a vLLM replica: SIGTERM while starting and serving, kill -9 and the next start's sweep ---------

def _wait_for(predicate, proc: subprocess.Popen, log_path: str, what: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"{what}: serve exited: " + open(log_path, errors="replace").read()[-3000:]
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _hotload(url: str, snapshot: int) -> dict:
    job = httpx.post(url + "/v1/hotload", json={"snapshot": snapshot}, timeout=30).json()
    deadline = time.monotonic() + 300
    while job["state"] not in ("READY", "FAILED"):
        assert time.monotonic() < deadline, job
        time.sleep(0.1)
        job = httpx.get(f"{url}/v1/hotload/{job['id']}", timeout=30).json()
    return job


def _leftovers(pid: int, *dirs: str) -> list[str]:
    return [os.path.join(d, n) for d in (*dirs, SHM) for n in _theirs(d, pid)]


@pytest.mark.slow     # three vLLM starts through the CLI (~42 s); the reference replica's SIGTERM case stays in make test
def test_a_vllm_replica_stopped_by_sigterm_starting_or_serving_leaves_nothing_and_kill_9_leftovers_are_swept(
        vllm_run, short_tmp, tmp_path):
    cache = os.path.join(short_tmp, "cache")
    env = {**os.environ, "TMPDIR": short_tmp, **ONE_GPU_LAYOUT_ENV}
    procs: list[subprocess.Popen] = []

    def start(name: str) -> tuple[subprocess.Popen, str]:
        path = str(tmp_path / name)
        cmd = [sys.executable, "-m", "ckptdelta", "-v", "serve", "--engine", "vllm", "--bucket", vllm_run.url,
               "--snapshot", "0", "--cache-dir", cache, "--port", "0", "--drain-timeout", "60", "--", *VLLM_ARGS]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(path, "wb")))
        return procs[-1], path

    def vllm_started(p: subprocess.Popen):   # its vLLM log exists: the model copy and host copy are made
        return lambda: any(n.startswith(f"ckptdelta-vllm-log-{p.pid}-") for n in os.listdir(short_tmp))

    def gone(children: list) -> bool:
        psutil.wait_procs(children, timeout=60)
        return not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]

    try:
        # 1. SIGTERM while vLLM starts: exit 0, nothing left (model copy, socket dir, log, host copy)
        p, log_path = start("sigterm-starting.log")
        _wait_for(vllm_started(p), p, log_path, "vLLM spawned")
        children = psutil.Process(p.pid).children(recursive=True)
        p.send_signal(signal.SIGTERM)
        assert p.wait(120) == 0, open(log_path).read()[-3000:]
        assert _leftovers(p.pid, short_tmp, cache) == [] and gone(children)
        assert os.listdir(short_tmp) == ["cache"]       # vLLM's own temp files (ZeroMQ sockets...) went too

        # 2. kill -9 while vLLM starts: everything stays behind ...
        k, log_path = start("killed.log")
        _wait_for(vllm_started(k), k, log_path, "vLLM spawned")
        k.kill()
        k.wait()
        left = _leftovers(k.pid, short_tmp, cache)
        kinds = sorted(os.path.basename(x).split(f"-{k.pid}-")[0] for x in left)
        assert kinds == ["ckptdelta-vllm", "ckptdelta-vllm-log", "ckptdelta-vllm-sock", "ckptdelta-weights",
                         "ckptdelta-weights"], left                    # the .bin and its index

        # 3. ... until the next replica starts: it sweeps them (keeping the dead one's vLLM log) and serves
        s, log_path = start("serving.log")
        port = _serving_port(s, log_path)
        assert _leftovers(k.pid, short_tmp, cache) == [x for x in left if "-vllm-log-" in x]

        # 4. a live replica's files survive another's sweep
        mine = _leftovers(s.pid, short_tmp, cache)
        assert len(mine) == 5, mine
        assert not [x for x in scratch.sweep_host(cache) if f"-{s.pid}-" in x]
        assert _leftovers(s.pid, short_tmp, cache) == mine

        # 5. a hot-load that fails after its shadow was built, before the pause (here: the positions file cannot
        #    be written), drops the shadow in vLLM's worker; the next one lands
        url = f"http://127.0.0.1:{port}"
        host_copy = [n for n in _theirs(SHM, s.pid) if n.endswith(".bin")]
        blocker = os.path.join(SHM, host_copy[0] + ".pos.tmp")
        os.mkdir(blocker)
        try:
            assert _hotload(url, 1)["state"] == "FAILED"
        finally:
            os.rmdir(blocker)
        assert "v00000001 built beside the live weights" in open(log_path, errors="replace").read()
        from ckptdelta.loader.engines.vllm.control import VllmControl

        control = VllmControl(httpx.get(url + "/v1/status", timeout=30).json()["engine"]["url"])
        try:
            mem = control.rpc("ckptdelta_memory", {})[0]
        finally:
            control.close()
        assert mem["shadow"] is None and mem["stray_modules"] == 0, mem
        assert _hotload(url, 1)["state"] == "READY"

        # 6. SIGTERM while serving: the request in flight is answered (by vLLM), then nothing is left
        children = psutil.Process(s.pid).children(recursive=True)
        assert children
        req, rest = _half_sent(port, {"prompt": PROMPT, "max_tokens": 8, "return_engine_data": True})
        _health(port)
        s.send_signal(signal.SIGTERM)
        _wait_until_refused(port, s)
        req.sendall(rest)
        answer = _response(req)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:500]
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["engine_data"]["policy_version"] == 1
        assert s.wait(120) == 0, open(log_path).read()[-3000:]
        assert _leftovers(s.pid, short_tmp, cache) == [] and gone(children)
        assert sorted(os.listdir(short_tmp)) == sorted(["cache"] + [os.path.basename(x) for x in left
                                                                    if "-vllm-log-" in x])
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
