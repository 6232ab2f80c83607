"""The publisher's temporary directories (anchor shards and delta parts on their way to the bucket).

Each is owned by a lock for as long as its publish runs (delta/scratch.py, as a
replica's scratch items are), so a publisher killed mid-publish (SIGKILL, the OOM
killer, a preempted node) does not leave gigabytes of shard files in the trainer's
temp dir for good: the next :class:`ckptdelta.publisher.Publisher` on the host removes the
directories no live process holds locked.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator

from ckptdelta.delta import scratch

log = logging.getLogger("ckptdelta.publisher")

KINDS = ("anchor", "delta")


@contextlib.contextmanager
def locked_tempdir(kind: str) -> Iterator[str]:
    """A new temporary directory of ``kind`` (anchor or delta), locked while the block runs, removed after."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: not one of {KINDS}")
    owned = scratch.make(kind)
    try:
        yield owned.path
    finally:
        owned.release()


def sweep(directory: str | None = None) -> list[str]:
    """Remove the publisher temporary directories in ``directory`` (default: the temp dir) whose owner is
    gone. Returns the paths removed; never raises."""
    directory = directory or tempfile.gettempdir()
    removed = [os.path.join(directory, n) for n in scratch.sweep(directory, KINDS)]
    if removed:
        log.info("removed %d temporary directories of publishers that died mid-publish (%s)", len(removed),
                 ", ".join(os.path.basename(p) for p in removed[:4]))
    return removed
