"""vLLM's OpenAI server as a child process of the replica: started on a Unix socket in a private
directory with the worker extension and dev mode, watched while it starts, and stopped with its whole
process group (and the shared memory its CPU all-reduce left, loader/engines/vllm/shm.py).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from typing import Sequence

import httpx
import torch


from ckptdelta.loader.engines.vllm import shm as vllm_shm
from ckptdelta.loader.engines.vllm.control import UNIX_PREFIX, VllmError, http_client

log = logging.getLogger("ckptdelta.engine.vllm")

WORKER_EXTENSION = "ckptdelta.loader.engines.vllm.worker.extension.CkptDeltaWorker"
#: Environment vLLM's dev endpoints and its CPU build need (set only where the user has not).
VLLM_ENV_DEFAULTS = {"VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1",
                     "VLLM_CPU_KVCACHE_SPACE": "1"}
START_TIMEOUT_S = 600.0
#: Seconds between the log lines that say the replica is still waiting for vLLM to start.
WAIT_LOG_EVERY_S = 10.0
#: Seconds vLLM gets to exit after SIGTERM before its process group is killed.
STOP_TIMEOUT_S = 15.0


# --- the vLLM server --------------------------------------------------------------------------

def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the replica process dies, however it dies (Linux), so a killed
    replica never leaves a vLLM server holding the port, the cores and the KV cache."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class VllmServer:
    """vLLM's OpenAI server as a child process (its own process group, stopped with us).

    By default it listens on a Unix socket in a fresh directory only this user can enter, not on a TCP port:
    its dev-mode endpoints (collective_rpc, reload_weights) answer anyone who can connect, and a port picked
    while vLLM starts (seconds to minutes) can be taken by another process meanwhile, or be the port another
    replica's vLLM answers on. ``port`` serves TCP on 127.0.0.1 instead (vLLM started the way a user may)."""

    def __init__(self, model_dir: str, *, served_name: str, args: Sequence[str] = (), port: int | None = None,
                 log_path: str | None = None, env: dict[str, str] | None = None):
        environ = {**os.environ, **(env or {})}
        for k, v in VLLM_ENV_DEFAULTS.items():
            environ.setdefault(k, v)
        ranks = _tensor_parallel_size(args)
        if ranks > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in environ and not torch.cuda.is_available():
            environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(ranks)
        from ckptdelta.delta.scratch import make as make_scratch

        self._dir = make_scratch("vllm-sock")    # mode 0700, locked while we live (delta/scratch.py)
        self._tmp: str | None = None
        if "TMPDIR" not in (env or {}):
            # vLLM's own temp files (its ZeroMQ sockets, torch.distributed's rendezvous file) were left in the
            # temp dir on every stop: they go in here, and go with it
            environ["TMPDIR"] = self._tmp = os.path.join(self._dir.path, "tmp")
            os.mkdir(environ["TMPDIR"], 0o700)
        # vLLM's CPU all-reduce shared memory, removed on stop: what is there before it starts is not its
        self._shm_before: set[str] | None = vllm_shm.segments()
        self._shm_idents: set[str] = set()
        if port is None:
            where = ["--uds", os.path.join(self._dir.path, "vllm.sock")]
            self.url = UNIX_PREFIX + where[1]
        else:
            where = ["--host", "127.0.0.1", "--port", str(port)]
            self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--served-model-name", served_name, *where, "--worker-extension-cls", WORKER_EXTENSION, *args]
        self._log = self._own_log = None
        try:
            # a log of our own is locked like the socket's directory: a dead replica's is kept for a while
            self._own_log = None if log_path else make_scratch("vllm-log")
            self.log_path = log_path or self._own_log.path
            self._log = open(self.log_path, "ab")
            log.info("starting vLLM on %s (its log: %s)", model_dir, self.log_path)
            log.debug("vLLM's command: %s", " ".join(cmd))
            self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=environ,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        except BaseException:
            if self._log is not None:
                self._log.close()
            if self._own_log is not None:
                self._own_log.release()
            self._dir.release()
            raise

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until vLLM answers /health; says every ``WAIT_LOG_EVERY_S`` that it is still waiting, with vLLM's last
        log line (a start takes from seconds to minutes, and vLLM's own output goes to its log)."""
        t0 = time.monotonic()
        deadline, said = t0 + timeout, t0
        with http_client(self.url, timeout=5.0) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise VllmError(f"vLLM exited with code {self.proc.returncode} while starting; its log is "
                                    f"{self.log_path}, its last lines:\n{self.tail()}")
                try:
                    if c.get("/health").status_code == 200:
                        log.info("vLLM is ready (%.0f s after it started)", time.monotonic() - t0)
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() - said >= WAIT_LOG_EVERY_S:
                    said = time.monotonic()
                    last = re.sub(r"^(\(\w+ pid=\d+\)\s*)?([A-Z]+ \d\d-\d\d [\d:]+\s*)?", "", self.tail(1).strip())
                    log.info("waiting for vLLM to start: %.0f s so far (log: %s; last line: %s)", said - t0,
                             self.log_path, last[-160:] or "none yet")
                time.sleep(0.5)
        self.stop(keep_log=True)
        raise VllmError(f"vLLM did not answer /health within {timeout:.0f} s; its log is {self.log_path}, its "
                        f"last lines:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-n:]).decode("utf-8", "replace")
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = STOP_TIMEOUT_S, *, keep_log: bool | None = None) -> None:
        """SIGTERM vLLM's process group, SIGKILL after ``timeout``; remove the socket's directory, and the log
        unless the user named it or it may tell why something failed: ``keep_log``, by default when vLLM had
        exited before it was asked to (a dead replica's logs are kept too: delta/scratch.py keeps the last
        few). Then whatever of the group still runs (vLLM's workers) is ended too, and the shared memory of vLLM's
        CPU all-reduce removed (loader/engines/vllm/shm.py). Idempotent."""
        crashed = self.proc.poll() is not None
        self._shm_idents |= vllm_shm.idents(self._tmp)    # before SIGTERM: a clean exit may remove the file
        if not crashed:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        vllm_shm.end_group(self.proc.pid, timeout, term=crashed)
        if self._shm_before is not None:
            ours = self._shm_idents | vllm_shm.idents(self._tmp)
            vllm_shm.remove_leftovers(self._shm_before, own=ours or None)
            self._shm_before = None
        self._log.close()
        self._dir.release()                              # the socket's directory (and vLLM's TMPDIR in it)
        own = self._own_log
        if own is not None and own.fd >= 0:
            if crashed if keep_log is None else keep_log:
                log.warning("vLLM's log is kept: %s", self.log_path)
                own.disown()
            else:
                own.release()


def _tensor_parallel_size(args: Sequence[str]) -> int:
    for i, a in enumerate(args):
        for flag in ("--tensor-parallel-size", "-tp"):
            if a == flag and i + 1 < len(args) and args[i + 1].isdigit():
                return int(args[i + 1])
            if a.startswith(flag + "=") and a.split("=", 1)[1].isdigit():
                return int(a.split("=", 1)[1])
    return 1


def cpu_thread_binding(ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` CPU workers: the cores this process may use, dealt out in turn.
    vLLM's CPU build binds one rank per NUMA node by default and refuses to start tensor parallelism on a host
    with fewer nodes than ranks ("Not enough allowed NUMA nodes"); ``serve`` sets this unless the user did."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < ranks:
        raise VllmError(f"--tensor-parallel-size {ranks} on vLLM's CPU build needs {ranks} cores; this process "
                        f"may use {len(cpus)}")
    return "|".join(",".join(str(c) for c in cpus[i::ranks]) for i in range(ranks))
