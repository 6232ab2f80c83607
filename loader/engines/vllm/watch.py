"""Watching the vLLM a replica forwards to: is it alive, and is it generating?

A replica that reports READY while its engine is dead, or paused with no swap
running, breaks the promise that every response comes from the version it
names (or comes at all): requests fail or hang behind a healthy-looking
``/health``. So a thread watches from outside, every ``interval`` seconds:

- the child process, when the replica started vLLM (its exit is final);
- vLLM's own ``/health`` (an attached vLLM has no child to wait on: ``misses``
  failed probes in a row mean it is gone);
- ``/is_paused`` while no swap runs: a vLLM left paused (a replica killed in
  the pause, a ``/resume`` that failed) is resumed; if it will not resume, that
  is a failure too.

A failure is final: :meth:`EngineWatch.failure` names it, and ``on_failure``
is called once (``ckptdelta serve`` exits non-zero so that a supervisor starts
a new replica). Nothing here is trusted with the weights: those are proven by
digests, never by liveness.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable

import httpx

if TYPE_CHECKING:
    from ckptdelta.loader.engines.vllm.applier import VllmApplier

log = logging.getLogger("ckptdelta.engine.vllm")

INTERVAL_S = 2.0
MISSES = 3
PROBE_TIMEOUT_S = 5.0


class EngineWatch:
    """A daemon thread probing one vLLM server; ``applier`` tells whether a swap is running (it pauses
    vLLM itself then) and resumes it (``applier._resume_engine``)."""

    def __init__(self, url: str, *, applier: "VllmApplier", proc: Any = None, api_key: str | None = None,
                 interval: float = INTERVAL_S, misses: int = MISSES,
                 on_failure: Callable[[str], None] | None = None):
        from ckptdelta.loader.engines.vllm.control import http_client

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url, self.applier, self.proc, self.interval, self.misses = url, applier, proc, interval, misses
        self.on_failure = on_failure
        self._http = http_client(url, timeout=PROBE_TIMEOUT_S, headers=headers)
        self._failure: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-watch", daemon=True)

    def start(self) -> "EngineWatch":
        self._thread.start()
        return self

    def failure(self) -> str | None:
        return self._failure

    def stop(self) -> None:
        """Stop watching, without waiting out a probe in flight (a replica stopping must not wait for it): the
        thread ends at its next check, and closes its client itself."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(0.5)
        if not self._thread.is_alive():
            self._http.close()

    # --- the probes ---------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._watch()
        finally:
            if self._stop.is_set():
                self._http.close()

    def _watch(self) -> None:
        missed = 0
        paused_seen = False
        while not self._stop.wait(self.interval):
            if self.proc is not None and self.proc.poll() is not None:
                self._fail(f"vLLM exited with code {self.proc.returncode}")
                return
            try:
                ok = self._http.get("/health").status_code == 200
            except (httpx.HTTPError, RuntimeError):    # RuntimeError: the client closed by stop()
                ok = False
            if self._stop.is_set():
                return
            missed = 0 if ok else missed + 1
            if missed >= self.misses:
                self._fail(f"vLLM at {self.url} did not answer /health {missed} times in a row "
                           f"({missed * self.interval:.0f} s)")
                return
            if not ok:
                continue
            paused = self._paused_outside_a_swap()
            if paused and paused_seen:          # twice in a row, no swap between: nobody will resume it
                if not self._resume():
                    return
                paused = False
            paused_seen = paused

    def _paused_outside_a_swap(self) -> bool:
        epoch = self.applier.epoch
        if self.applier.swapping:
            return False
        try:
            r = self._http.get("/is_paused")
            paused = r.status_code == 200 and bool(r.json().get("is_paused"))
        except (httpx.HTTPError, ValueError, AttributeError):
            return False
        return paused and not self.applier.swapping and self.applier.epoch == epoch

    def _resume(self) -> bool:
        log.error("vLLM at %s is paused and no hot-load is running (a replica killed in its pause, or a resume "
                  "that failed): resuming it", self.url)
        try:
            self.applier._resume_engine()
            return True
        except Exception as e:  # noqa: BLE001 - any failure to resume leaves every request frozen
            self._fail(f"vLLM at {self.url} is paused outside a hot-load and does not resume ({e})")
            return False

    def _fail(self, why: str) -> None:
        if self._failure is not None:
            return
        self._failure = why
        log.critical("the replica's engine failed: %s", why)
        if self.on_failure is not None:
            try:
                self.on_failure(why)
            except Exception:  # noqa: BLE001 - the failure is recorded whatever the callback does
                log.exception("on_failure callback failed")

