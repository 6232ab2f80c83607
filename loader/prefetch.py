"""The guards around a reader's prefetching: a thread pool of its own (verify), or the fetches a generator keeps in
flight on the reader's kept threads (the reader, the hot swap)."""

from __future__ import annotations

import contextlib
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator


@contextlib.contextmanager
def prefetching(ex: ThreadPoolExecutor) -> Iterator[ThreadPoolExecutor]:
    """``ex`` shut down when the block ends, waiting for its thread unless the block is a generator being
    closed: the garbage collector closes an abandoned generator wherever it runs, also inside threading's
    own bookkeeping while that holds a lock which joining a thread takes again (CPython's
    ``_shutdown_locks_lock``), and the join then waits forever (seen: a reader hung after a refused record).
    A fetch still in flight then finishes on its own, its result dropped."""
    wait = True
    try:
        yield ex
    except GeneratorExit:
        wait = False
        raise
    finally:
        ex.shutdown(wait=wait, cancel_futures=True)


class InFlight:
    """The fetches a generator has handed to long-lived threads (loader/threads.py) and not yet taken."""

    def __init__(self) -> None:
        self._held: list[Future] = []

    def add(self, fut: Future) -> Future:
        self._held = [f for f in self._held if not f.done()]
        self._held.append(fut)
        return fut

    def drop(self, wait: bool) -> None:
        for f in self._held:
            if not f.cancel() and wait:
                futures.wait([f])


@contextlib.contextmanager
def in_flight() -> Iterator[InFlight]:
    """:func:`prefetching` for fetches on kept threads: when the block ends, a fetch not started is dropped and
    one running is waited for (its result dropped), so nothing is fetched for the block once it has ended;
    except when the block is a generator being closed, which the garbage collector may do anywhere: the
    fetch then finishes on its own."""
    held = InFlight()
    wait = True
    try:
        yield held
    except GeneratorExit:
        wait = False
        raise
    finally:
        held.drop(wait)
