"""Long-lived daemon threads for the work a hot-load hands off: its job, the run's check beside its resolve, the
next fetch batch, its staging.

Each of those once started a thread of its own (or a pool's) per hot-load. ``Thread.start()`` returns only once
the new thread runs and has taken the GIL, which on a replica whose cores vLLM keeps busy can take a while: a
py-spy profile of the LoRA benchmark under its sampling load put ~38 ms of every hot-load in ``Thread.start``,
though without the profiler's own load the difference was within the benchmark's noise (docs/PERFORMANCE.md,
"LoRA runs, what a busy host adds"). A thread started once and kept, waiting on a queue, takes the next task as
soon as it is woken.

Daemon threads, as the per-hot-load threads were: an interpreter that exits does not wait for a hot-load. A
thread idle for :data:`IDLE_EXIT_S` ends (the next task starts one again), so a process that makes many
readers or replicas, as a test suite does, does not keep their threads for good.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

#: Seconds a thread waits for a task before it ends: longer than an RL step's gap between hot-loads.
IDLE_EXIT_S = 60.0


class Threads:
    """At most ``n`` daemon threads named ``name-<i>``, each started the first time a task finds no idle one,
    then kept; tasks run in submission order. ``submit`` returns a :class:`concurrent.futures.Future`, which
    may be cancelled until a thread takes it."""

    def __init__(self, n: int, name: str) -> None:
        if n < 1:
            raise ValueError(f"{name}: at least one thread, got {n}")
        self.n, self.name = n, name
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0                   # threads waiting for a task, at most (see _work)
        self._running = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        fut: Future = Future()
        with self._lock:
            self._tasks.put((fut, fn, args, kwargs))
            if self._idle > 0:
                self._idle -= 1          # that thread takes it: a second task finds no idle one
                return fut
            if self._threads >= self.n:
                return fut               # a busy thread takes it once free
            self._threads += 1
            i = self._threads
        try:
            threading.Thread(target=self._work, name=f"{self.name}-{i}", daemon=True).start()
        except BaseException:
            with self._lock:
                self._threads -= 1
                if self._threads == 0:   # no thread will ever take it: a thread started later skips it
                    fut.cancel()
            raise
        return fut

    def _work(self) -> None:
        while True:
            try:
                task = self._tasks.get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:
                    if self._tasks.empty():
                        # counted idle (or its count already taken by a task another thread ran): a submit
                        # after this starts a thread where none is left waiting
                        self._threads -= 1
                        self._idle = max(0, self._idle - 1)
                        return
                continue
            self._run(*task)
            del task                     # nothing of a finished task is kept while waiting for the next
            with self._lock:
                if self._tasks.empty():
                    self._idle += 1
                    continue
            # more queued: take the next at once, without being counted idle

    @property
    def alive(self) -> int:
        """Threads started and not ended (tests)."""
        return self._threads

    @property
    def busy(self) -> int:
        """Tasks running now: 0 once everything handed over has ended."""
        return self._running

    def _run(self, fut: Future, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        with self._lock:
            self._running += 1
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:       # noqa: BLE001 - the submitter sees it on the future
            with self._lock:
                self._running -= 1       # before the future says so: whoever it wakes sees the task ended
            fut.set_exception(e)
        else:
            with self._lock:
                self._running -= 1
            fut.set_result(result)
