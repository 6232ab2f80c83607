"""Host buffers for the next copy, filled while the trainer steps.

Until a second publish hands its superseded parent back, the next host copy would land in fresh memory, and
first-touching it (the kernel maps and zeroes every page) costs more than the copy itself: the first delta
after a publisher starts would pay it inside publish(). A fill thread pays it while the trainer steps (one
thread, no torch threads). A publish that comes first stops the fill and takes the buffers filled so far; they
would be allocated at the next publish anyway."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

import torch

from ckptdelta.delta import dtypes

log = logging.getLogger("ckptdelta.publisher")


class Prefault:
    """One fill at a time into a dict that stays the publisher's spare set only while ``is_current`` says so."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock      # the publisher's: guards its spare set and this fill
        self._running: tuple[threading.Thread, threading.Event] | None = None

    @property
    def thread(self) -> threading.Thread | None:
        running = self._running
        return None if running is None else running[0]

    def start(self, like: Mapping[str, torch.Tensor], target: dict[str, torch.Tensor],
              is_current: Callable[[dict[str, torch.Tensor]], bool]) -> None:
        """Fill ``target`` with buffers shaped like ``like``; called under the lock."""
        shapes = [(n, t.dtype, tuple(t.shape), t.is_pinned()) for n, t in like.items()]
        stop = threading.Event()

        def fill() -> None:
            try:
                for n, dtype, shape, pin in shapes:
                    if stop.is_set():
                        return
                    t = torch.empty(shape, dtype=dtype, pin_memory=pin)
                    dtypes.host_bits(t).fill(0)
                    with self._lock:
                        if stop.is_set() or not is_current(target):
                            return
                        target[n] = t
            except Exception as e:  # noqa: BLE001 - an optimisation only: the next copy allocates instead
                log.debug("filling spare host buffers failed (%s); the next publish allocates them", e)

        thread = threading.Thread(target=fill, name="ckptdelta-prefault", daemon=True)
        thread.start()
        self._running = (thread, stop)

    def join(self) -> None:
        """Stop a fill still running (what it filled stays in its target) and wait for it."""
        with self._lock:
            running, self._running = self._running, None
        if running is not None:
            running[1].set()
            running[0].join()
