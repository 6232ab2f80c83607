"""How ``ckptdelta serve`` stops on SIGTERM: as on Ctrl-C, cleaning up, after draining, with exit status 0.

SIGTERM is how replicas are stopped (``kill``, ``Popen.terminate``, Kubernetes,
systemd). Python's default action for it ends the process at once: no
``finally`` runs, so the scratch model copy, vLLM's socket directory and log
and the host copy in ``/dev/shm`` were left behind on every stop. Here SIGTERM
raises :class:`TerminationRequested` (a ``KeyboardInterrupt``, so every
clean-up path that Ctrl-C takes runs for it too). While the replica serves,
uvicorn takes both signals over: it stops accepting connections, lets requests
in flight finish for up to ``--drain-timeout`` seconds, cancels what is left,
then raises the signal again, which lands here. Later SIGTERMs are ignored so
that clean-up is not cut short (SIGKILL remains; the next replica on the host
sweeps what a killed one left: delta/scratch.py).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from typing import Any, Iterator

log = logging.getLogger("ckptdelta.server")

#: Seconds ``serve`` lets requests in flight finish after SIGTERM or Ctrl-C before it cancels them.
DRAIN_TIMEOUT_S = 25.0


class TerminationRequested(KeyboardInterrupt):
    """SIGTERM: stop as on Ctrl-C (every clean-up runs), then exit 0."""


def _raise_once(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, _ignore)
    raise TerminationRequested()


def _ignore(signum: int, frame: Any) -> None:
    log.warning("SIGTERM again: already stopping, cleaning up")


@contextlib.contextmanager
def sigterm_stops() -> Iterator[None]:
    """Inside: the first SIGTERM raises :class:`TerminationRequested` in the main thread (nothing happens
    outside the main thread, where Python cannot handle signals). The previous handler is restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_once)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def shield() -> None:
    """From now on SIGTERM is ignored (logged): the process is cleaning up and then exits anyway."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _ignore)
