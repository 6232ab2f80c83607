"""The guard around the fetch a reader's generator keeps in flight on the reader's kept threads (loader/threads.py):
shared by the reader, verify and the hot swap."""

from __future__ import annotations

import contextlib
from concurrent import futures
from concurrent.futures import Future
from typing import Iterator


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
    """When the block ends, a fetch not started is dropped and one running is waited for (its result dropped),
    so nothing is fetched for the block once it has ended; except when the block is a generator being closed:
    the garbage collector closes an abandoned generator wherever it runs, also inside threading's own
    bookkeeping while that holds a lock that waiting on a thread may need (seen: a reader hung after a refused
    record), so the fetch then finishes on its own, its result dropped."""
    held = InFlight()
    wait = True
    try:
        yield held
    except GeneratorExit:
        wait = False
        raise
    finally:
        held.drop(wait)
