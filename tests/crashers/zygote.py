"""A fork server for crash tests: pays the imports once, then forks one publisher child per trial.

Starting a Python process that imports torch, numba and the publisher takes
seconds on a busy machine; a crash test that kills fifty publishers would
spend minutes importing. The zygote imports (and JIT-compiles the codec
kernels) once, single-threaded, then forks a child per ``spawn`` command.

Protocol (JSON lines): the test writes ``{"cmd": "spawn", ...}`` to the
zygote's stdin; the zygote answers SPAWNED (with the child's pid), the child
writes its own events (tests/crashers/publish_loop.py) to the same stdout, and
the zygote reports EXITED (code or signal) once the child is dead. The child
stays an unreaped zombie until the test sends ``{"cmd": "reap"}``: until then
its pid cannot be reused, so the test's SIGKILL can only ever hit its own child.

:class:`Zygote` is the test's side.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _emit(ev: str, **fields: Any) -> None:
    os.write(1, (json.dumps({"pid": os.getpid(), "ev": ev, **fields}) + "\n").encode())


def _warm_up() -> None:
    """Compile (or load) the codec kernels here, so that no child spends its life in the JIT: encoding
    anchors and deltas, and the decoding a restarted publisher does to rebuild its parent."""
    import tempfile

    from ckptdelta.publisher import Publisher
    from tests.crashers.publish_loop import weights_for

    with tempfile.TemporaryDirectory(prefix="ckptdelta-zygote-") as d:
        with Publisher(os.path.join(d, "run"), progress=False) as pub:
            pub.publish(weights_for(0, 0), 0)
            pub.publish(weights_for(0, 1), 1)
        with Publisher(os.path.join(d, "run"), progress=False) as pub:
            pub.publish(weights_for(0, 2), 2)


def serve() -> None:
    import torch

    torch.set_num_threads(1)
    from tests.crashers import publish_loop

    _warm_up()
    _emit("READY")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        if cmd["cmd"] == "reap":
            os.waitpid(int(cmd["pid"]), 0)
            _emit("REAPED", child=int(cmd["pid"]))
            continue
        if cmd["cmd"] != "spawn":
            _emit("BAD", cmd=cmd)
            continue
        pid = os.fork()
        if pid == 0:
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            publish_loop.child_main(cmd)
        _emit("SPAWNED", child=pid)
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        sig = info.si_status if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else None
        code = info.si_status if info.si_code == os.CLD_EXITED else None
        _emit("EXITED", child=pid, signal=sig, code=code)


class Zygote:
    """The test's handle on a zygote process: spawn a child, read its events, kill it, reap it."""

    def __init__(self, log_path: str, *, start_timeout: float = 300.0) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.crashers.zygote"], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log)
        self.log_path = log_path
        self._events: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.child: int | None = None
        self._child_dead = True
        self.expect("READY", timeout=start_timeout)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self._events.put(json.loads(line))
            except ValueError:
                self._events.put({"ev": "GARBLED", "line": line.decode(errors="replace")})
        self._events.put({"ev": "ZYGOTE_GONE"})

    def _send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def next_event(self, timeout: float) -> dict[str, Any] | None:
        """The next event (None after ``timeout`` seconds without one)."""
        try:
            ev = self._events.get(timeout=timeout)
        except queue.Empty:
            return None
        if ev.get("ev") == "EXITED" and ev.get("child") == self.child:
            self._child_dead = True
        if ev.get("ev") == "ZYGOTE_GONE":
            raise RuntimeError(f"the zygote died; its log:\n{self.log_tail()}")
        return ev

    def expect(self, ev: str, *, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            got = self.next_event(max(0.0, left)) if left > 0 else None
            if got is None:
                raise TimeoutError(f"no {ev} event from the zygote within {timeout}s; its log:\n{self.log_tail()}")
            if got["ev"] == ev:
                return got

    def spawn(self, **cmd: Any) -> int:
        assert self._child_dead, "the previous child is still alive"
        self._send({"cmd": "spawn", **cmd})
        self.child = int(self.expect("SPAWNED", timeout=60)["child"])
        self._child_dead = False
        return self.child

    def kill_child(self) -> bool:
        """SIGKILL the current child if it has not exited yet (it cannot have been reaped: see module doc)."""
        if self.child is None or self._child_dead:
            return False
        os.kill(self.child, signal.SIGKILL)
        return True

    def reap(self) -> None:
        assert self.child is not None and self._child_dead
        self._send({"cmd": "reap", "pid": self.child})
        self.expect("REAPED", timeout=60)
        self.child = None

    def log_tail(self, n: int = 6000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")[-n:]
        except OSError:
            return ""

    def close(self) -> None:
        try:
            if self.child is not None and not self._child_dead:
                self.kill_child()
                while not self._child_dead and self.next_event(30) is not None:
                    pass
            if self.child is not None and self._child_dead:
                self.reap()
            self._send({"cmd": "quit"})
            self.proc.wait(timeout=30)
        except Exception:  # noqa: BLE001 - the zygote is ours: make sure it is gone
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=30)
        finally:
            self._log.close()


if __name__ == "__main__":
    serve()
