"""The publisher's temporary directories (anchor shards and delta parts on their way to the bucket).

Each is locked (``flock`` on a file inside it) for as long as its publish runs, so a
publisher killed mid-publish (SIGKILL, the OOM killer, a preempted node) does not
leave gigabytes of shard files in the trainer's temp dir for good: the next
:class:`publisher.Publisher` on the host removes the directories no live process
holds locked. A lock, not a pid: pids are reused, and another container on the
host may publish with pids this process cannot see.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator

log = logging.getLogger("ckptdelta.publisher")

PREFIXES = ("ckptdelta-anchor-", "ckptdelta-delta-")
_OWNER = ".owner"


@contextlib.contextmanager
def locked_tempdir(prefix: str) -> Iterator[str]:
    """A new temporary directory, locked while the block runs, removed after it. The lock file gets its name
    only once locked, so a sweep never finds it unlocked while its owner lives."""
    if not prefix.startswith(PREFIXES):
        raise ValueError(f"prefix {prefix!r}: not one of {PREFIXES}")
    path = tempfile.mkdtemp(prefix=prefix)
    fd = -1
    try:
        tmp = os.path.join(path, _OWNER + ".tmp")
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(tmp, os.path.join(path, _OWNER))
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        if fd >= 0:
            os.close(fd)


def sweep(directory: str | None = None) -> list[str]:
    """Remove the publisher temporary directories in ``directory`` (default: the temp dir) whose owner is
    gone: ours, with a lock file nobody holds. Directories without one (being created, or left by an older
    ckptdelta) and other users' are left alone. Returns the paths removed; never raises."""
    directory = directory or tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(directory) if n.startswith(PREFIXES)]
    except OSError:
        return []
    removed = []
    for name in names:
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            fd = os.open(os.path.join(path, _OWNER), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue                  # its publisher is still running
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d temporary directories of publishers that died mid-publish (%s)", len(removed),
                 ", ".join(os.path.basename(p) for p in removed[:4]))
    return removed
