"""An on-disk cache of fetched byte ranges, shared by the replicas of one host.

Eight replicas on one machine hot-loading the same delta should download it once.
Entries are content-addressed: the key is the stored object's xxh3 and size plus the
byte range, all validated numbers, so two runs (or two buckets) holding the same
object share entries and no key is ever built from a string a bucket controls.

Several processes use one directory: an entry is written to a temp file and
published with ``os.replace`` (readers see a whole entry or none), and every entry
carries its own xxh3, checked on each read. A damaged entry is deleted and reported
as a miss, so the caller refetches; the caller still verifies what it gets against
the manifest, so the cache can only cost time, never correctness.

Replicas that hot-load the same step at the same moment fetch each range once
(single flight): a miss takes a claim on the entry (an ``flock`` on a file beside
it) and returns None, the caller fetches and ``put`` releases the claim; a reader
that finds the entry claimed by another process waits for it to appear, at most
``wait_s`` seconds, then fetches it itself. A claim held by a process that died is
free at once (the kernel drops its lock); a reader whose fetch fails, or whose caller
stops it, gives its claims back (``release``, loader/reader.py); one left anyway without
a ``put`` is passed over after ``wait_s``. Claims are never taken in one process against
another thread of the same process (the second fetches too, as without claims).

The cache is bounded by default (:func:`default_max_bytes`: a quarter of its
file system, at most 32 GiB, or ``$CKPTDELTA_CACHE_MAX_GB``): a run publishes
a delta per step, and a replica that hot-loads every one of them for weeks
would otherwise fill the disk. Only entries are evicted, least recently used
first (a hit refreshes an entry); anything else in the directory, such as a
live replica's scratch model copy, is never touched (delta/scratch.py sweeps
dead replicas' copies).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import struct
import threading
import time
import uuid

import xxhash

log = logging.getLogger("ckptdelta.loader.cache")

_MAGIC = b"CKDCACH1"
_HEAD = struct.Struct("<8sQQ")  # magic, payload length, xxh3-64 of the payload
_HEX16 = re.compile(r"[0-9a-f]{16}")
_SUBDIR = re.compile(r"[0-9a-f]{2}")
_ENTRY = re.compile(r"[0-9a-f]{16}(-[0-9]{1,19}){3}")
_TMP = ".tmp-"
_CLAIM = ".tmp-claim-"   # beside the entry; a temp name, so stale ones are removed with stale temp files
#: Environment variable bounding every cache of the process, in GiB (0: no bound); ``serve --cache-max-gb``.
MAX_GB_ENV = "CKPTDELTA_CACHE_MAX_GB"
#: The default bound: this share of the cache's file system, at most DEFAULT_MAX_BYTES.
DEFAULT_DISK_SHARE = 0.25
DEFAULT_MAX_BYTES = 32 << 30
#: ``DiskCache(max_bytes=DEFAULT)``: the bound :func:`default_max_bytes` picks.
DEFAULT = -1

# entry path -> (locked claim fd, monotonic time taken): the claims this process holds, over all instances
_CLAIMS: dict[str, tuple[int, float]] = {}
_CLAIMS_LOCK = threading.Lock()


def default_max_bytes(root: str) -> int | None:
    """``$CKPTDELTA_CACHE_MAX_GB`` GiB (0: None, no bound), else a quarter of ``root``'s file system, at most
    32 GiB."""
    raw = os.environ.get(MAX_GB_ENV, "").strip()
    if raw:
        try:
            gb = float(raw)
        except ValueError:
            raise ValueError(f"{MAX_GB_ENV}={raw!r}: expected a number of GiB (0: no bound)") from None
        return None if gb <= 0 else int(gb * (1 << 30))
    try:
        st = os.statvfs(root)
    except OSError:
        return DEFAULT_MAX_BYTES
    return max(1 << 30, min(DEFAULT_MAX_BYTES, int(st.f_blocks * st.f_frsize * DEFAULT_DISK_SHARE)))


class DiskCache:
    """Byte ranges of stored objects, keyed by (object xxh3, object size, start, end).

    ``max_bytes`` bounds the directory's entries: once writes have added about a tenth
    of it, the least recently used entries (by mtime, refreshed on every hit) are
    deleted until the total fits. Other processes pruning the same directory is
    harmless. By default (``DEFAULT``) the bound is :func:`default_max_bytes`;
    ``None``: no bound.
    ``wait_s``: how long a miss waits for another process fetching the same entry
    (see the module docstring); 0 turns single flight off."""

    def __init__(self, root: str, *, max_bytes: int | None = DEFAULT, wait_s: float = 60.0) -> None:
        self.root = os.path.abspath(root)
        self.wait_s = float(wait_s)
        os.makedirs(self.root, exist_ok=True)
        self.max_bytes = default_max_bytes(self.root) if max_bytes == DEFAULT else max_bytes
        self._lock = threading.Lock()
        self._written_since_prune = 0

    def path(self, obj_xxh3: str, obj_size: int, start: int, end: int) -> str:
        if not (isinstance(obj_xxh3, str) and _HEX16.fullmatch(obj_xxh3)):
            raise ValueError(f"cache key: {obj_xxh3!r} is not a 16-digit hex xxh3")
        for v in (obj_size, start, end):
            if not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62):
                raise ValueError(f"cache key: {v!r} is not a valid size or offset")
        if not start <= end <= obj_size:
            raise ValueError(f"cache key: range {start}-{end} outside an object of {obj_size} bytes")
        return os.path.join(self.root, obj_xxh3[:2], f"{obj_xxh3}-{obj_size}-{start}-{end}")

    def get(self, obj_xxh3: str, obj_size: int, start: int, end: int) -> bytes | None:
        """The cached bytes, or None (absent or damaged; a damaged entry is removed). A None from a miss
        claims the entry for the caller, who is expected to ``put`` it (or ``discard`` it on failure)."""
        path = self.path(obj_xxh3, obj_size, start, end)
        data = self._read(path, end - start)
        if data is not None or self.wait_s <= 0:
            return data
        deadline = time.monotonic() + self.wait_s
        nap = 0.002
        while True:
            claimed, data = self._claim(path, end - start)
            if claimed or data is not None:
                return data
            if time.monotonic() >= deadline:
                log.info("cache entry %s: still being fetched by another process after %.0f s; fetching it too",
                         path, self.wait_s)
                return None
            time.sleep(nap)
            nap = min(2 * nap, 0.05)
            data = self._read(path, end - start)
            if data is not None:
                return data

    def _read(self, path: str, length: int) -> bytes | None:
        try:
            with open(path, "rb") as f:
                blob = f.read(_HEAD.size + length + 1)
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("cache entry %s unreadable (%s); treating as a miss", path, e)
            return None
        if len(blob) == _HEAD.size + length:
            magic, n, h = _HEAD.unpack_from(blob, 0)
            data = blob[_HEAD.size:]
            if magic == _MAGIC and n == length and xxhash.xxh3_64_intdigest(data) == h:
                try:
                    os.utime(path)
                except OSError:
                    pass
                return data
        log.warning("cache entry %s is damaged; discarding it", path)
        _unlink(path)
        return None

    def _claim(self, path: str, length: int) -> tuple[bool, bytes | None]:
        """(True, None): this process now holds the claim (or already did); (False, data): the entry
        appeared; (False, None): another process holds it."""
        with _CLAIMS_LOCK:
            held = _CLAIMS.get(path)
            if held is not None:
                if time.monotonic() - held[1] < self.wait_s:
                    return True, None          # ours already: another thread, or a try that failed
                _CLAIMS.pop(path)             # ours but stale (a fetch that never put): take it anew
                _drop_claim(path, held[0])
            directory, name = os.path.split(path)
            try:
                os.makedirs(directory, exist_ok=True)
                fd = os.open(os.path.join(directory, _CLAIM + name), os.O_CREAT | os.O_RDWR, 0o600)
            except OSError as e:
                log.warning("could not claim cache entry %s (%s); fetching without a claim", path, e)
                return True, None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                return False, None
            data = self._read(path, length)    # published between our miss and our lock?
            if data is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
                return False, data
            _CLAIMS[path] = (fd, time.monotonic())
            return True, None

    def _release(self, path: str) -> None:
        with _CLAIMS_LOCK:
            held = _CLAIMS.pop(path, None)
            if held is not None:
                _drop_claim(path, held[0])

    def put(self, obj_xxh3: str, obj_size: int, start: int, end: int, data: bytes | memoryview) -> None:
        """Store verified bytes. Failures (disk full, permissions) are logged, never raised."""
        path = self.path(obj_xxh3, obj_size, start, end)
        if len(data) != end - start:
            raise ValueError(f"cache put: {len(data)} bytes for a {end - start}-byte range")
        directory = os.path.dirname(path)
        tmp = os.path.join(directory, f"{_TMP}{os.getpid()}-{uuid.uuid4().hex}")
        try:
            os.makedirs(directory, exist_ok=True)
            with open(tmp, "xb") as f:
                f.write(_HEAD.pack(_MAGIC, len(data), xxhash.xxh3_64_intdigest(data)))
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("could not write cache entry %s: %s", path, e)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            self._release(path)
            return
        self._release(path)
        if self.max_bytes is not None:
            with self._lock:
                self._written_since_prune += len(data) + _HEAD.size
                due = self._written_since_prune > max(1, self.max_bytes // 10)
                if due:
                    self._written_since_prune = 0
            if due:
                self.prune()

    def discard(self, obj_xxh3: str, obj_size: int, start: int, end: int) -> None:
        path = self.path(obj_xxh3, obj_size, start, end)
        _unlink(path)
        self._release(path)

    def release(self, obj_xxh3: str, obj_size: int, start: int, end: int) -> None:
        """Give back the claim a miss took, without an entry: the fetch failed, or its caller stopped. Until
        then, every other replica of the host that misses the entry waits for it (``wait_s``)."""
        self._release(self.path(obj_xxh3, obj_size, start, end))

    def entries(self) -> list[tuple[str, int, float]]:
        """(path, size, mtime) of every entry. Only names this class writes count: temp files of writers
        in flight and anything else sharing the directory are left alone."""
        out = []
        try:
            subdirs = os.listdir(self.root)
        except OSError:
            return out
        for sub in subdirs:
            if not _SUBDIR.fullmatch(sub):
                continue
            d = os.path.join(self.root, sub)
            try:
                names = os.listdir(d)
            except OSError:
                continue
            for name in names:
                if not _ENTRY.fullmatch(name):
                    continue
                try:
                    st = os.stat(os.path.join(d, name))
                except OSError:
                    continue
                out.append((os.path.join(d, name), st.st_size, st.st_mtime))
        return out

    def size_bytes(self) -> int:
        return sum(s for _p, s, _m in self.entries())

    def prune(self, max_bytes: int | None = None) -> int:
        """Delete least recently used entries until the cache fits, and temp files a crashed
        writer left behind over an hour ago; returns bytes freed."""
        self._remove_stale_temps()
        limit = self.max_bytes if max_bytes is None else max_bytes
        if limit is None:
            return 0
        entries = sorted(self.entries(), key=lambda e: e[2])
        total = sum(e[1] for e in entries)
        freed = 0
        for path, size, _mtime in entries:
            if total - freed <= limit:
                break
            try:
                os.unlink(path)
                freed += size
            except OSError:
                pass
        return freed

    def _remove_stale_temps(self, age_s: float = 3600.0) -> None:
        now = time.time()
        for sub in _listdir(self.root):
            if not _SUBDIR.fullmatch(sub):
                continue
            d = os.path.join(self.root, sub)
            for name in _listdir(d):
                if name.startswith(_TMP):
                    path = os.path.join(d, name)
                    try:
                        if now - os.stat(path).st_mtime > age_s:
                            os.unlink(path)
                    except OSError:
                        pass


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _drop_claim(path: str, fd: int) -> None:
    """Remove the claim file, then unlock: a waiter that locks the old file finds the entry (or none and
    claims it; a newcomer may then claim a new file too, which costs a second fetch, never a wrong byte)."""
    directory, name = os.path.split(path)
    _unlink(os.path.join(directory, _CLAIM + name))
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
