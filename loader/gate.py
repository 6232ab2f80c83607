"""The serving gate: forward steps and the commit of a hot-load exclude each other, so no forward step
ever sees a mix of two versions, and a pause is only as long as the writes it covers.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator


from ckptdelta.delta.errors import HotLoadError



# --- the gate ---------------------------------------------------------------------------

@dataclass
class Pause:
    """Filled in by :meth:`ServingGate.paused` (or an applier's): ``waited_s`` for running steps to end,
    ``seconds`` in all, from ``started`` (``time.perf_counter()`` when the engine stopped)."""

    waited_s: float = 0.0
    seconds: float = 0.0
    started: float = 0.0


class ServingGate:
    """Forward steps (many at once) against the swap (one at a time, exclusive).

    ``with gate.serving():`` around each forward step; ``with gate.paused() as pause:``
    waits for running steps to end, holds new ones back until the block exits, and
    sets ``pause.seconds``. A pending pause has priority: new steps wait behind it,
    so a swap is never starved by a steady stream of requests. Sections nest within
    a thread; pausing from inside a serving section would deadlock and raises instead."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._pausing = False
        self._writer = threading.Lock()
        self._local = threading.local()

    @property
    def active(self) -> int:
        """Forward steps running now."""
        return self._active

    @property
    def is_paused(self) -> bool:
        return self._pausing

    @contextmanager
    def serving(self) -> Iterator[None]:
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            with self._cond:
                while self._pausing:
                    self._cond.wait()
                self._active += 1
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth
            if depth == 0:
                with self._cond:
                    self._active -= 1
                    if self._active == 0:
                        self._cond.notify_all()

    @contextmanager
    def paused(self, timeout: float | None = None) -> Iterator[Pause]:
        """Exclusive access to the weights. With ``timeout``, gives up (HotLoadError) if running
        steps have not ended by then, and lets held-back steps go on."""
        if getattr(self._local, "depth", 0):
            raise HotLoadError("cannot pause the model from inside a serving section (it would wait for itself)")
        t0 = time.perf_counter()
        pause = Pause(started=t0)
        with self._writer:
            with self._cond:
                self._pausing = True
                deadline = None if timeout is None else t0 + timeout
                try:
                    while self._active:
                        left = None if deadline is None else deadline - time.perf_counter()
                        if left is not None and left <= 0:
                            raise HotLoadError(f"{self._active} forward steps still running after {timeout:.1f}s; "
                                               "swap abandoned, weights unchanged")
                        self._cond.wait(left)
                except BaseException:     # the timeout, or Ctrl-C / a stop signal while the swap waited on the
                    self._pausing = False  # main thread: held-back steps go on, never blocked for good
                    self._cond.notify_all()
                    raise
            pause.waited_s = time.perf_counter() - t0
            try:
                yield pause
            finally:
                with self._cond:
                    self._pausing = False
                    self._cond.notify_all()
                pause.seconds = time.perf_counter() - t0
