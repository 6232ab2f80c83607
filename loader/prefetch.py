"""The guard around a reader's prefetching thread pool (shared by the reader, verify and the hot swap)."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
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
