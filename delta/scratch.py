"""What a replica or a publisher leaves on its host (scratch model copies, vLLM's socket directory and log, the
host copy of the weights in shared memory, a publisher's shards and parts on their way to the bucket), owned by a
lock, so that any replica or publisher can sweep what a dead one left.

A replica killed -9, or by SIGBUS, or SIGTERM'd before it could clean up, leaves
a whole model on disk and another in ``/dev/shm``; nothing else will ever remove
them. Judging "dead" by the pid in a name is wrong across PID namespaces:
containers sharing ``/dev/shm`` (``--ipc=host``) see other pids, or the same
pid belonging to another process, and a sweeper would delete a live replica's
host copy. So each item is locked by its owner for as long as it lives
(``flock`` on the file or directory itself: a lock belongs to the open file,
lives in the kernel, crosses PID namespaces and goes away with the owner
however it dies), and a sweeper removes only an item it can lock itself.

Names: ``ckptdelta-<kind>-<pid>-<tag><suffix>``, the pid for people reading a
listing (and tests), never for judging; files beside an item that extend its
name (``...bin.json``, ``...bin.pos``) go with it. Only this module's names
of this user are touched, and never through a symlink. Dead owners' vLLM logs
are kept for diagnosis, the newest :data:`KEEP_LOGS` of them.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import secrets
import shutil
import stat
import tempfile
from dataclasses import dataclass

log = logging.getLogger("ckptdelta.scratch")

#: kind -> (suffix of the locked item, is a directory)
KINDS: dict[str, tuple[str, bool]] = {
    "weights": (".bin", False),     # the host copy in shared memory (loader/engines/shared_weights.py)
    "vllm": ("", True),             # the scratch model copy vLLM loads (loader/engines/vllm/replica.py build())
    "vllm-sock": ("", True),        # the directory of vLLM's Unix socket (VllmServer)
    "vllm-log": (".log", False),    # vLLM's log (VllmServer), kept after a crash
    "serve": ("", True),            # the reference engine's scratch copy while it loads (loader/engines/reference/model.py)
    "anchor": ("", True),           # a publisher's anchor shards on their way up (publisher/tempdirs.py)
    "delta": ("", True),            # a publisher's delta parts on their way up (publisher/tempdirs.py)
}
#: kinds with files beside them: the host copy's index and positions files (``PATH.json``, ``PATH.pos``)
WITH_SIBLINGS = ("weights",)
#: Logs of dead owners kept per directory (newest first); older ones are removed by the next sweep.
KEEP_LOGS = 5
_NAME = re.compile(r"ckptdelta-(?P<kind>vllm-sock|vllm-log|weights|vllm|serve|anchor|delta)-(?P<pid>[0-9]{1,10})-"
                   r"(?P<tag>[0-9a-f]{8})(?P<rest>.*)", re.S)


@dataclass
class Owned:
    """A file or directory this process owns: ``fd`` holds its lock until :meth:`release` (or process exit)."""

    path: str
    fd: int
    is_dir: bool

    def release(self) -> None:
        """Remove it and what extends its name beside it (siblings first, the locked item last), then unlock."""
        if self.fd < 0:
            return
        try:
            _remove_with_siblings(self.path, self.is_dir)
        finally:
            self._close()

    def disown(self) -> None:
        """Unlock and keep it: from now on it is a dead owner's (a kept log, for instance)."""
        self._close()

    def _close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def make(kind: str, directory: str | None = None) -> Owned:
    """A new item of ``kind`` in ``directory`` (default: the temp dir), created 0600/0700 and locked."""
    suffix, is_dir = KINDS[kind]
    directory = os.path.abspath(directory or tempfile.gettempdir())
    for _ in range(100):
        path = os.path.join(directory, f"ckptdelta-{kind}-{os.getpid()}-{secrets.token_hex(4)}{suffix}")
        try:
            if is_dir:
                os.mkdir(path, 0o700)
            else:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            continue
        if is_dir:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:    # a sweeper found it unlocked and removed it before we could open it
                continue
        # a sweeper may have locked and removed it between its creation and our lock: then try another name
        if _lock(fd) and _same(path, fd):
            return Owned(path, fd, is_dir)
        os.close(fd)
    raise OSError(errno.EEXIST, f"could not create a scratch {kind} in {directory}")


def sweep(directory: str, kinds: "tuple[str, ...] | None" = None, *, keep_logs: int = KEEP_LOGS) -> list[str]:
    """Remove the items (and their siblings) in ``directory`` whose owner is gone: those nobody holds locked.
    Returns the names removed. Never raises for what it cannot remove (logged at debug)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    groups: dict[str, list[str]] = {}
    for name in names:
        m = _NAME.fullmatch(name)
        if not m or (kinds is not None and m["kind"] not in kinds):
            continue
        suffix = KINDS[m["kind"]][0]
        if m["rest"] == suffix or (m["kind"] in WITH_SIBLINGS and m["rest"].startswith(suffix + ".")):
            groups.setdefault(name[:m.start("rest")], []).append(name)
    removed: list[str] = []
    dead_logs: list[tuple[float, str]] = []
    for stem, members in groups.items():
        kind = _NAME.fullmatch(stem)["kind"]
        suffix, is_dir = KINDS[kind]
        anchor = os.path.join(directory, stem + suffix)
        fd = _open_if_ours(anchor, is_dir)
        if fd is None:
            if os.path.lexists(anchor):
                continue          # not ours to judge (another user's, a symlink, the wrong type)
            # siblings with no item: their owner created the item first and removes it last, so it is gone
            for name in members:
                path = os.path.join(directory, name)
                fd = _open_if_ours(path, False)
                if fd is not None:
                    os.close(fd)
                    if _remove(path, False):
                        removed.append(name)
            continue
        try:
            if not (_lock(fd) and _same(anchor, fd)):
                continue          # alive (or removed meanwhile by another sweeper)
            if kind == "vllm-log":
                dead_logs.append((os.fstat(fd).st_mtime, stem + suffix))
                continue
            _remove_with_siblings(anchor, is_dir)
            removed.extend(sorted(members))
        finally:
            os.close(fd)
    dead_logs.sort(reverse=True)
    for _mtime, name in dead_logs[keep_logs:]:
        if _remove_with_siblings(os.path.join(directory, name), False):
            removed.append(name)
    if removed:
        log.info("removed what dead replicas left in %s: %s", directory, ", ".join(sorted(removed)[:8]))
    return removed


#: Where a replica's host copy of the weights lives, when set (loader/engines/shared_weights.py).
SHM_DIR_ENV = "CKPTDELTA_SHM_DIR"


def shm_dir() -> str:
    """``$CKPTDELTA_SHM_DIR``, else ``/dev/shm`` where it exists (memory, visible to every process of the host),
    else the temp dir."""
    if os.environ.get(SHM_DIR_ENV):
        return os.environ[SHM_DIR_ENV]
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def sweep_host(*directories: "str | None") -> list[str]:
    """Sweep the places replicas leave things: the temp dir, the host copy's directory and ``directories``
    (a ``--cache-dir``). Returns the paths removed."""
    removed = []
    seen = set()
    for d in (tempfile.gettempdir(), shm_dir(), *directories):
        if d and os.path.realpath(d) not in seen:
            seen.add(os.path.realpath(d))
            removed += [os.path.join(d, n) for n in sweep(d)]
    return removed


# --- helpers ----------------------------------------------------------------------------------------

def _lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


def _same(path: str, fd: int) -> bool:
    """``path`` still names the file ``fd`` is open on (not removed, not replaced)."""
    try:
        a, b = os.lstat(path), os.fstat(fd)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _open_if_ours(path: str, is_dir: bool) -> int | None:
    """An fd on ``path`` if it is an item this user could own, of the right type, not a symlink; else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if st.st_uid != os.geteuid() or not (stat.S_ISDIR(st.st_mode) if is_dir else stat.S_ISREG(st.st_mode)):
        return None
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_DIRECTORY if is_dir else os.O_NONBLOCK)
    try:
        return os.open(path, flags)
    except OSError:
        return None


def _remove_with_siblings(path: str, is_dir: bool) -> bool:
    """Remove what extends ``path``'s name beside it (``PATH.*``), then ``path`` itself; True when it is gone."""
    directory, base = os.path.split(path)
    try:
        names = os.listdir(directory)
    except OSError:
        names = []
    for name in names:
        if name.startswith(base + "."):
            _remove(os.path.join(directory, name))
    return _remove(path, is_dir)


def _remove(path: str, is_dir: bool | None = None) -> bool:
    try:
        if is_dir or (is_dir is None and stat.S_ISDIR(os.lstat(path).st_mode)):
            shutil.rmtree(path)
        else:
            os.unlink(path)
        return True
    except FileNotFoundError:
        return True
    except OSError as e:
        log.debug("could not remove %s: %s", path, e)
        return False
