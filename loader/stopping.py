"""How ``ckptdelta serve`` stops: on SIGTERM, SIGINT or SIGHUP alike, drained, cleaned up, with exit status 0.

These are the signals supervisors stop a process with: SIGTERM (``kill``, ``Popen.terminate``, Kubernetes,
systemd, ``docker stop``), SIGINT (Ctrl-C, supervisord's or Docker's ``STOPSIGNAL SIGINT``, systemd's
``KillSignal=SIGINT``), SIGHUP (a closed terminal or SSH session, systemd's ``SendSIGHUP``). Python's default
action for SIGTERM and SIGHUP ends the process at once: no ``finally`` runs, so the scratch model copy, vLLM's
socket directory and log and the host copy in ``/dev/shm`` were left behind. Here each of them raises
:class:`TerminationRequested` (a ``KeyboardInterrupt``, so every clean-up path runs for it), and ``serve``
exits 0: a stop a supervisor asked for is not a failure (systemd counts 130, Ctrl-C's usual status, as one).

While the replica serves, uvicorn takes the three over (:func:`uvicorn_server`): it stops accepting
connections, lets requests in flight finish for up to ``--drain-timeout`` seconds, cancels what is left (a
plain request is answered 503 ``replica_stopping``, a stream ends with that error as an event, then
``[DONE]``: loader/server.py), then raises the signal again, which lands here. A hot-load is not cut by a
stop (loader/hotload_jobs.py, ``HotLoadManager.stop``): one still preparing stops at its next tensor, having
touched nothing; one past its prepare runs to its end, so the pause it began ends on bits it proved (the new
version's, or the previous version's put back) and the engine it paused, a user's vLLM included, generates
again before the engine is closed. Nor is the replica's start cut where it paused a user's vLLM to push the
snapshot in (:func:`deferred`): the stop comes once that vLLM is proven and generating. Later signals are
ignored so that clean-up is not cut short (a second Ctrl-C while draining ends the drain at once, as uvicorn
does; SIGKILL remains, and the next replica on the host sweeps what a killed one left: delta/scratch.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Any, Callable, Iterator

log = logging.getLogger("ckptdelta.server")

#: Seconds ``serve`` lets requests in flight finish after a stop signal before it cancels them.
DRAIN_TIMEOUT_S = 25.0
#: The signals that stop ``serve`` gracefully.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_requested = threading.Event()
_reason: list[str] = []
_deferring: list[str] = []      # what the main thread is doing that a stop must not cut (deferred())
_pending: list[int] = []        # a stop signal that came inside deferred(), raised at its end


class TerminationRequested(KeyboardInterrupt):
    """A stop signal (SIGTERM, SIGINT, SIGHUP): stop as on Ctrl-C (every clean-up runs), then exit 0."""


def request(signum: int) -> None:
    """Record that a stop was asked for, by ``signum`` (the first one names the stop). Called from signal
    handlers: it only sets a flag."""
    if not _reason:
        _reason.append(signal.Signals(signum).name)
    _requested.set()


def requested() -> bool:
    """Whether a stop signal has come."""
    return _requested.is_set()


def reason() -> str:
    """The signal that stopped the replica ("SIGTERM"...), or "a stop" when none did."""
    return _reason[0] if _reason else "a stop"


def _raise_once(signum: int, frame: Any) -> None:
    request(signum)
    shield()
    if _deferring:
        log.warning("%s: stopping once done %s", signal.Signals(signum).name, _deferring[-1])
        _pending.append(signum)
        return
    raise TerminationRequested()


def _ignore(signum: int, frame: Any) -> None:
    log.warning("%s: already stopping, cleaning up", signal.Signals(signum).name)


@contextlib.contextmanager
def signals_stop() -> Iterator[None]:
    """Inside: the first of SIGTERM, SIGINT, SIGHUP raises :class:`TerminationRequested` in the main thread
    (nothing happens outside the main thread, where Python cannot handle signals); the previous handlers are
    restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _raise_once) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def deferred(what: str) -> Iterator[None]:
    """Inside (in the main thread, while the replica starts): a stop signal does not cut the block, where it
    would land anywhere; it is raised when the block ends. For a pause the replica began in an engine it does
    not own (a user's vLLM, paused to push the snapshot in: loader/engines/vllm/replica.py): cut there, the pause
    would outlive the replica. ``what`` is logged with the stop."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _deferring.append(what)
    try:
        yield
    finally:
        _deferring.pop()
    if not _deferring and _pending:
        _pending.clear()
        raise TerminationRequested()


def shield() -> None:
    """From now on the stop signals are ignored (logged): the process is cleaning up and then exits anyway."""
    if threading.current_thread() is threading.main_thread():
        for s in STOP_SIGNALS:
            signal.signal(s, _ignore)


def uvicorn_server(config: Any, *, on_stop: Callable[[], None]) -> Any:
    """A ``uvicorn.Server`` that drains on SIGHUP as on SIGTERM (uvicorn itself takes only SIGTERM and SIGINT:
    SIGHUP's default action would end the process mid-request) and calls ``on_stop()`` as soon as a stop
    signal comes, before the drain: a hot-load still preparing is dropped then, not after it (the replica's
    hot-load manager; ``on_stop`` runs in a signal handler, so it must only set flags)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            request(sig)
            on_stop()
            super().handle_exit(sig, frame)

        def _hangup(self, sig: int, frame: Any) -> None:
            request(sig)
            self.handle_exit(signal.SIGTERM, frame)   # drained as SIGTERM is; uvicorn raises SIGTERM again after

        async def serve(self, sockets: Any = None) -> None:
            if threading.current_thread() is not threading.main_thread():
                await super().serve(sockets)
                return
            previous = signal.signal(signal.SIGHUP, self._hangup)
            try:
                await super().serve(sockets)
            finally:
                signal.signal(signal.SIGHUP, previous)

    return Server(config)


# --- tests only: a signal that lands in a named phase of a hot-load -----------------------------------------

#: Tests only (tests/loader/test_stops.py): ``PHASE:PATH`` holds this process's first hot-load that reaches PHASE
#: (:data:`PHASES`) there, after creating the file PATH, until a stop signal comes; so a test's signal lands in
#: that phase, wherever the machine's load puts the rest.
HOLD_ENV = "CKPTDELTA_TEST_HOLD_HOTLOAD"
#: prepare: fetching and verifying while serving; pause: the engine paused, nothing written yet; proof: the new
#: bits written, not proven yet; resume: proven, the pause not ended yet. And "takeover": not a hot-load's, the
#: replica's start pushing the snapshot into an attached vLLM it paused (loader/engines/vllm/replica.py).
PHASES = ("prepare", "pause", "proof", "resume")
HOLD_TIMEOUT_S = 300.0
_held: set[str] = set()


def hold(phase: str) -> None:
    """Where a hot-load enters ``phase``: nothing unless :data:`HOLD_ENV` names it (see there)."""
    spec = os.environ.get(HOLD_ENV)
    if not spec or phase in _held or spec.partition(":")[0] != phase:
        return
    _held.add(phase)
    log.warning("%s: held in the %s phase until a stop signal comes", HOLD_ENV, phase)
    with open(spec.partition(":")[2], "w"):
        pass
    if not _requested.wait(HOLD_TIMEOUT_S):
        log.warning("%s: no stop signal came within %.0f s; the hot-load goes on", HOLD_ENV, HOLD_TIMEOUT_S)
