"""One small key -> bytes interface over fsspec, so publisher/ and loader/ never see a backend.

Keys are '/'-separated paths relative to the run's root URL. Everything above this
module speaks in keys; only this module knows about fsspec filesystems, their
error types and how each backend makes a create-only write.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import random
import shutil
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Iterable, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from ckptdelta.delta.errors import (CkptDeltaError, InvalidKeyError, ObjectExistsError, ObjectNotFoundError,
                                    ObjectTooLargeError, StorageError, StorageURLError)

log = logging.getLogger("ckptdelta.storage")
T = TypeVar("T")

#: Basename prefix of local temp files; list_prefix hides them (a writer may be mid-put).
_TMP_PREFIX = ".ckptdelta-tmp-"
#: S3's minimum multipart part size; s3fs goes multipart at 2 parts, so files >= 10 MiB.
_S3_PART_SIZE = 5 * 2**20
_S3_MAX_PARTS = 10_000
#: gcsfs switches to a resumable upload at its chunksize; fake-gcs-server (and only it)
#: ignores ifGenerationMatch there, so create-only writes always go in one request.
_GCS_SIMPLE_UPLOAD_MIN_CHUNK = 50 * 2**20
#: Characters refused in keys: path tricks, and glob/query syntax that fsspec or
#: s3fs would interpret ('*?[' expand as globs in rm, '?versionId=' in s3fs paths).
_BAD_KEY_CHARS = frozenset("\\*?[]") | frozenset(chr(c) for c in range(32)) | {"\x7f"}

_TRANSIENT_ERRNOS = frozenset({
    errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED,
    errno.ECONNREFUSED, errno.EPIPE, getattr(errno, "EREMOTEIO", errno.EIO),
})
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
    "ServiceUnavailable", "TooManyRequests", "RequestLimitExceeded", "OperationAborted",
    "RequestTimeoutException", "PriorRequestNotComplete",
})
_MEMORY_CREATE_LOCK = threading.Lock()  # MemoryFileSystem's store is process-global

#: Seconds one storage operation may take, its retries included, before it fails (docs/PUBLISHING.md).
DEFAULT_TIMEOUT_S = 60.0
#: Environment variable that replaces DEFAULT_TIMEOUT_S (``ckptdelta --storage-timeout`` sets it); 0: no bound.
TIMEOUT_ENV = "CKPTDELTA_STORAGE_TIMEOUT"
#: A transfer's time bound grows by one second per this many bytes it moves: slow big uploads are not cut off.
_MIN_RATE = 1 << 20


def default_timeout() -> float | None:
    """The storage timeout in force: ``$CKPTDELTA_STORAGE_TIMEOUT`` if set (0: none), else DEFAULT_TIMEOUT_S."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise StorageError(f"${TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if not value >= 0:
        raise StorageError(f"${TIMEOUT_ENV}={raw!r} must be >= 0 seconds (0: no bound)")
    return None if value == 0 or math.isinf(value) else value


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter for transient errors, within a time bound.

    ``attempts`` counts every try, the first one included. Jitter spreads the
    replicas of a fleet that all hit the same throttled prefix at once.
    ``timeout`` bounds the seconds one operation takes, its retries and the client
    libraries' own retries included (None: no bound; the default comes from
    :func:`default_timeout`): no retry starts past it, and on s3:// and gs:// a try
    still running then is cancelled. A transfer's bound grows by one second per MiB
    it moves, so only a stalled or unreachable store hits it.
    """

    attempts: int = 6
    base_delay: float = 0.1
    max_delay: float = 5.0
    timeout: float | None = field(default_factory=default_timeout)

    def delay(self, attempt: int) -> float:
        """Sleep before try ``attempt + 1``: uniform in [cap/2, cap], cap doubling per try."""
        cap = min(self.max_delay, self.base_delay * 2 ** (attempt - 1))
        return random.uniform(cap / 2, cap)


_transient_types_cache: tuple[type, ...] | None = None


def _transient_types() -> tuple[type, ...]:
    """Client-library exception types that mean "try again"; imported only if installed."""
    global _transient_types_cache
    if _transient_types_cache is None:
        types: list[type] = [TimeoutError, ConnectionError]
        try:
            import aiohttp
            types += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError]
        except ImportError:
            pass
        try:
            from botocore import exceptions as bex
            from botocore.parsers import ResponseParserError  # throttled replies can be bad XML
            types += [bex.HTTPClientError, bex.ConnectionError, ResponseParserError]
        except ImportError:
            pass
        try:
            from requests import exceptions as rex
            types += [rex.ConnectionError, rex.Timeout, rex.ChunkedEncodingError]
        except ImportError:
            pass
        _transient_types_cache = tuple(types)
    return _transient_types_cache


def _http_status_and_code(exc: BaseException) -> tuple[int | None, str | None]:
    """HTTP status / service error code from botocore, aiohttp or gcsfs exceptions."""
    resp = getattr(exc, "response", None)
    if isinstance(resp, dict):  # botocore ClientError
        err = resp.get("Error") or {}
        status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        return (int(status) if status else None), err.get("Code")
    for attr in ("status", "code"):  # aiohttp ClientResponseError.status, gcsfs HttpError.code
        val = getattr(exc, attr, None)
        if isinstance(val, int) or (isinstance(val, str) and val.isdigit()):
            return int(val), None
    return None, None


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the same request may succeed (throttling, 5xx, resets, timeouts).

    Walks the cause chain because s3fs turns a botocore ClientError into a plain
    OSError and keeps the original (with its HTTP status) as ``__cause__``.
    """
    if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError,
                        IsADirectoryError, NotADirectoryError, CkptDeltaError)):
        return False
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, _transient_types()):
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
        status, code = _http_status_and_code(e)
        if status in _TRANSIENT_STATUS or code in _TRANSIENT_CODES:
            return True
        e = e.__cause__ or e.__context__
    return False


def check_key(key: str, *, what: str = "key") -> str:
    """Return ``key`` if it is a safe relative key, else raise InvalidKeyError.

    Keys come from manifests a hostile bucket may control: an absolute path or
    '..' must never let a reader or writer escape the run's root.
    """
    if not isinstance(key, str) or not key:
        raise InvalidKeyError(f"invalid storage {what} {key!r}: must be a non-empty string")
    if key.startswith("/"):
        raise InvalidKeyError(f"invalid storage {what} {key!r}: absolute")
    bad = _BAD_KEY_CHARS.intersection(key)
    if bad:
        raise InvalidKeyError(f"invalid storage {what} {key!r}: contains {sorted(bad)!r}")
    for seg in key.split("/"):
        if seg in ("", ".", ".."):
            raise InvalidKeyError(f"invalid storage {what} {key!r}: empty, '.' or '..' segment")
    return key


def is_temp_key(key: str) -> bool:
    """Whether ``key`` is the temp file of a local write: never an object, debris if its writer died."""
    return key.rsplit("/", 1)[-1].startswith(_TMP_PREFIX)


def _mtime(info: dict[str, Any]) -> float | None:
    """Modification time in epoch seconds from whatever field the backend reports."""
    for name in ("mtime", "LastModified", "last_modified", "updated", "modified", "created"):
        val = info.get(name)
        if isinstance(val, datetime):
            return val.timestamp()
        if isinstance(val, (int, float)) and not isinstance(val, bool):
            return float(val)
        if isinstance(val, str):
            try:
                return datetime.fromisoformat(val.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None


def fsync_dir(path: str) -> None:
    """Make a rename/link durable; best effort where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class Store:
    """Key -> bytes access to one run's root URL, with retries and create-only writes.

    Guarantees per backend:

    * ``put``/``put_file``: readers see the old or the new object, never a part
      of one. Local: temp file in the same directory + fsync + ``os.replace``;
      memory: one dict assignment; S3/GCS: single PUT or completed multipart
      upload. Other fsspec backends: whatever their ``pipe_file`` gives.
    * ``put_if_absent`` (``atomic_create`` True): local uses ``os.link`` of a
      complete temp file (fails atomically if the name exists); memory checks
      and writes under a process-wide lock (one process only); S3 sends
      ``If-None-Match: *`` (AWS S3 and moto enforce it; older S3 clones may
      ignore it silently); GCS sends ``ifGenerationMatch=0`` in one request.
      Other backends fall back to exists-then-write with ``atomic_create``
      False: two racers can both "win" and the last write stays.
    * A create whose response was lost and is retried by this class is
      recognised (the object now holds exactly our bytes) and reported as
      success. Retries made inside s3fs/gcsfs are invisible here: such a
      lost-response create surfaces as ObjectExistsError.
    * Transient errors are retried per ``retry`` on top of the client
      libraries' own retries; not-found is never retried.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, *,
                 retry: RetryPolicy | None = None, max_workers: int = 16) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url: str = fs.unstrip_protocol(self.root)
        self.retry = retry or RetryPolicy()
        self.stats: dict[str, int] = {"requests": 0, "retries": 0}
        protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
        if isinstance(fs, LocalFileSystem):
            self.backend = "local"
        elif isinstance(fs, MemoryFileSystem):
            self.backend = "memory"
        elif protocols & {"s3", "s3a"}:
            self.backend = "s3"
        elif protocols & {"gs", "gcs"}:
            self.backend = "gcs"
        else:
            self.backend = "other"
        self.atomic_create: bool = self.backend != "other"
        # s3fs and gcsfs (fsspec async backends) take a per-call ``timeout`` that cancels the request
        self._cancellable = self.backend in ("s3", "gcs") and bool(getattr(fs, "async_impl", False))
        self._max_workers = max_workers
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, storage_options: dict[str, Any] | None = None,
                 retry: RetryPolicy | None = None) -> "Store":
        """Open a plain path, file://, memory://, s3://, gs:// or any fsspec URL.

        Remote listing caches are disabled: a loader polls for objects other
        processes write, and a cached listing would hide them.
        """
        opts = dict(storage_options or {})
        protocol = fsspec.core.split_protocol(url)[0] or "file"
        if protocol not in ("file", "local", "memory"):
            opts.setdefault("use_listings_cache", False)
        try:
            fs, root = fsspec.core.url_to_fs(url, **opts)
        except ImportError as e:   # fsspec: "Install s3fs to access S3"
            extra = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}.get(protocol)
            how = f"pip install 'ckptdelta[{extra}]'" if extra else "install the fsspec backend for it"
            raise StorageURLError(f"{url}: the {protocol}:// client library is not installed ({how}): {e}") from None
        except ValueError as e:
            if "protocol" not in str(e).lower():
                raise StorageURLError(f"{url}: {e}") from None
            raise StorageURLError(f"{url}: unknown storage protocol {protocol!r} (use a local path, file://, "
                                  "s3://, gs:// or another fsspec protocol)") from None
        except TypeError as e:     # an option the backend's constructor does not take
            raise StorageURLError(f"{url}: the {protocol}:// backend refused the storage options: {e}") from None
        return cls(fs, root, retry=retry)

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the get_many/delete worker threads (the Store stays usable)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    # --- helpers -----------------------------------------------------------------

    def key_url(self, key: str) -> str:
        """Full URL of ``key``, for messages the user can act on."""
        return f"{self.url}/{key}"

    def _path(self, key: str) -> str:
        check_key(key)
        return f"{self.root}/{key}" if self.root else key

    def _map(self, fn: Callable[[Any], T], items: list[Any]) -> list[T]:
        if len(items) <= 1:
            return [fn(i) for i in items]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix="ckptdelta-store")
            pool = self._pool
        return list(pool.map(fn, items))

    def _run(self, op: str, key: str, fn: Callable[..., T], *, nbytes: int = 0) -> T:
        """Run one backend call with retries within the policy's time bound, translating errors to
        ckptdelta.delta.errors. ``fn(**kw)`` passes ``kw`` (a ``timeout`` on cancellable backends) to the fsspec call."""
        policy = self.retry
        t0 = time.monotonic()
        bound = None if policy.timeout is None else policy.timeout + nbytes / _MIN_RATE
        attempts = max(1, policy.attempts)
        for attempt in range(1, attempts + 1):
            with self._lock:
                self.stats["requests"] += 1
            kw: dict[str, Any] = {}
            if bound is not None and self._cancellable:
                kw["timeout"] = max(0.1, bound - (time.monotonic() - t0))
            try:
                return fn(**kw)
            except CkptDeltaError:
                raise
            except FileNotFoundError as e:
                missing = ObjectNotFoundError(f"{op} {self.key_url(key)}: no such object")
                missing.key = key      # so a caller can say which manifest entry wanted it
                raise missing from e
            except FileExistsError as e:
                raise ObjectExistsError(f"{op} {self.key_url(key)}: object already exists") from e
            except Exception as e:
                cause = _describe(e, kw.get("timeout"))
                if not is_transient(e):
                    raise StorageError(f"{op} {self.key_url(key)} failed: {cause}") from e
                elapsed = time.monotonic() - t0
                delay = policy.delay(attempt)
                if bound is not None and elapsed + delay >= bound:
                    tries = f"{attempt} attempt{'s' if attempt > 1 else ''}"
                    raise StorageError(
                        f"{op} {self.key_url(key)} failed within the {policy.timeout:g} s storage timeout "
                        f"({tries}, last: {cause}); check the URL, the endpoint and the network, or raise the "
                        f"bound (--storage-timeout SECONDS, ${TIMEOUT_ENV})") from e
                if attempt >= attempts:
                    raise StorageError(f"{op} {self.key_url(key)} failed after {attempt} "
                                       f"attempts in {elapsed:.1f}s: {cause}") from e
                with self._lock:
                    self.stats["retries"] += 1
                log.info("%s %s: transient error (attempt %d/%d), retrying in %.2fs: %s",
                         op, self.key_url(key), attempt, attempts, delay, cause)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _local_write(self, path: str, write: Callable[[Any], None], *, create_only: bool) -> None:
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp: str | None = os.path.join(directory, f"{_TMP_PREFIX}{uuid.uuid4().hex}")
        try:
            with open(tmp, "xb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            if create_only:
                os.link(tmp, path)  # atomic: EEXIST if the name exists, never a partial file
            else:
                os.replace(tmp, path)
                tmp = None
            fsync_dir(directory)
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass

    # --- reads -------------------------------------------------------------------

    def get(self, key: str, byte_range: tuple[int, int] | None = None, *,
            max_size: int | None = None) -> bytes:
        """Bytes of ``key``, or of the half-open ``byte_range`` (shorter if the object is).

        With ``max_size`` the read is capped at one byte past the limit and a
        larger object is refused, so a hostile or corrupt bucket cannot make the
        caller allocate more than that, even if the object grows meanwhile. The
        object's size is not asked first: that HEAD was a round trip more on
        every manifest, HEAD and RUN.json read (a hot-load's resolve); only a
        refusal asks it, for its message.
        """
        path = self._path(key)
        if byte_range is not None:
            start, end = (int(x) for x in byte_range)
            if start < 0 or end < start:
                raise ValueError(f"invalid byte range {byte_range!r} for {self.key_url(key)}")
            if max_size is not None and end - start > max_size:
                raise ObjectTooLargeError(f"get {self.key_url(key)}: range of {end - start} bytes "
                                          f"exceeds the {max_size}-byte limit")
        elif max_size is not None:
            start, end = 0, max_size + 1
        else:
            start = end = None  # type: ignore[assignment]
        if start is not None and start == end:
            self.size(key)  # an empty range still requires the object (S3 would send it all)
            return b""
        def read(**kw: Any) -> bytes:
            stop = end
            if self.backend == "local" and stop is not None:
                # a local read allocates the whole length asked for before reading: a range taken
                # from a hostile manifest must not turn into a terabyte-sized buffer
                stop = min(stop, max(start, os.path.getsize(path)))
            return self.fs.cat_file(path, start=start, end=stop, **kw)

        try:
            data = self._run("get", key, read, nbytes=0 if start is None or end is None else end - start)
        except ObjectNotFoundError:
            raise
        except StorageError:
            # S3/GCS answer 416 for a range starting at or past the end; local and
            # memory return b"". Normalise to the latter.
            if start is None or not self._starts_past_end(key, start):
                raise
            return b""
        if max_size is not None and len(data) > max_size:
            raise ObjectTooLargeError(f"get {self.key_url(key)}: object is {self._size_for_message(key)}, larger "
                                      f"than the {max_size}-byte limit")
        if start is not None and end is not None and len(data) > end - start:
            raise StorageError(f"get {self.key_url(key)}: server returned {len(data)} bytes "
                               f"for a {end - start}-byte range")
        return data

    def _size_for_message(self, key: str) -> str:
        try:
            return f"{self.size(key)} bytes"
        except StorageError:
            return "of unknown size"

    def _starts_past_end(self, key: str, start: int) -> bool:
        try:
            return start >= self.size(key)
        except StorageError:
            return False  # keep the caller's original error

    def get_many(self, keys_and_ranges: Iterable[tuple[str, tuple[int, int] | None]]) -> list[bytes]:
        """``get`` for each (key, range) in parallel, results in input order."""
        items = list(keys_and_ranges)
        for key, _ in items:
            check_key(key)
        return self._map(lambda kr: self.get(kr[0], kr[1]), items)

    def info(self, key: str) -> dict[str, Any]:
        """``{"size": int, "mtime": float | None}``; a 'directory' is not an object."""
        path = self._path(key)

        def fn(**kw: Any) -> dict[str, Any]:
            info = self.fs.info(path, **kw)
            if info.get("type") == "directory":
                raise FileNotFoundError(path)
            return {"size": int(info["size"]), "mtime": _mtime(info)}

        return self._run("info", key, fn)

    def size(self, key: str) -> int:
        return self.info(key)["size"]

    def exists(self, key: str) -> bool:
        try:
            self.info(key)
        except ObjectNotFoundError:
            return False
        return True

    def list_prefix(self, prefix: str = "", *, include_temp: bool = False) -> list[str]:
        """Sorted keys starting with ``prefix`` (plain string prefix, as S3 lists), recursive.

        ``list_prefix("a/")`` lists everything under a/; ``list_prefix("a")`` also
        matches "ab". Listings are never served from a cache. Temp files of local
        writes (in flight, or left by a writer killed mid-write: see
        :func:`is_temp_key`) are hidden unless ``include_temp``, which gc uses to
        remove them.
        """
        if prefix:
            check_key(prefix[:-1] if prefix.endswith("/") else prefix, what="prefix")
        directory = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        dpath = f"{self.root}/{directory}".rstrip("/") if directory else self.root

        tail = prefix.rsplit("/", 1)[-1]

        def fn(**kw: Any) -> list[str]:
            self.fs.invalidate_cache(dpath)
            try:
                if tail and self.backend in ("s3", "gcs"):
                    # the store filters: listing one version's objects does not page through every version's
                    return list(self.fs.find(dpath, prefix=tail, **kw))
                if tail and self.backend == "local":
                    return [p for entry in self.fs.ls(dpath, detail=False)
                            if entry.rstrip("/").rsplit("/", 1)[-1].startswith(tail)
                            for p in self.fs.find(entry, **kw)]
                return list(self.fs.find(dpath, **kw))
            except FileNotFoundError:
                return []

        root_prefix = f"{self.root}/" if self.root else ""
        keys = []
        for path in self._run("list", prefix, fn):
            if not path.startswith(root_prefix) or path.endswith("/"):
                continue
            key = path[len(root_prefix):]
            if not key.startswith(prefix):
                continue
            if self.backend == "local" and not include_temp and is_temp_key(key):
                continue
            keys.append(key)
        return sorted(keys)

    # --- writes ------------------------------------------------------------------

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Write ``key`` (overwriting); readers see the old or the new bytes, never a mix."""
        path = self._path(key)
        if self.backend == "local":
            self._run("put", key, lambda: self._local_write(path, lambda f: f.write(data),
                                                            create_only=False))
            return
        payload = bytes(data)
        self._run("put", key, lambda **kw: self.fs.pipe_file(path, payload, **kw), nbytes=len(payload))

    def put_if_absent(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Create ``key`` or raise ObjectExistsError; see the class docstring per backend."""
        path = self._path(key)
        payload = bytes(data)
        attempts = 0

        def create(kw: dict[str, Any]) -> None:
            if self.backend == "local":
                self._local_write(path, lambda f: f.write(payload), create_only=True)
            elif self.backend == "memory":
                with _MEMORY_CREATE_LOCK:
                    if self.fs.exists(path):
                        raise FileExistsError(path)
                    self.fs.pipe_file(path, payload)
            elif self.backend == "s3":
                self.fs.pipe_file(path, payload, mode="create", **kw)
            elif self.backend == "gcs":
                chunksize = max(_GCS_SIMPLE_UPLOAD_MIN_CHUNK, len(payload) + 1)
                self.fs.pipe_file(path, payload, mode="create", chunksize=chunksize, **kw)
            else:
                if self.fs.exists(path, **kw):
                    raise FileExistsError(path)
                self.fs.pipe_file(path, payload, **kw)

        def fn(**kw: Any) -> None:
            nonlocal attempts
            attempts += 1
            try:
                create(kw)
            except FileExistsError:
                # An earlier try of ours may have landed with its answer lost.
                if attempts > 1 and self.fs.cat_file(path, **kw) == payload:
                    return
                raise

        self._run("put_if_absent", key, fn, nbytes=len(payload))

    def put_file(self, key: str, local_path: str | os.PathLike[str]) -> None:
        """Upload a local file without reading it whole (multipart on S3, resumable on GCS)."""
        path = self._path(key)
        src = os.fspath(local_path)
        if self.backend == "local":
            def copy(f: Any) -> None:
                with open(src, "rb") as fin:
                    shutil.copyfileobj(fin, f, 8 * 2**20)
            self._run("put_file", key, lambda: self._local_write(path, copy, create_only=False))
        elif self.backend == "memory":  # MemoryFileSystem.put_file shows a growing file
            def pipe() -> None:
                with open(src, "rb") as fin:
                    self.fs.pipe_file(path, fin.read())
            self._run("put_file", key, pipe)
        elif self.backend == "s3":
            size = os.path.getsize(src)
            chunk = max(_S3_PART_SIZE, math.ceil(size / _S3_MAX_PARTS))
            self._run("put_file", key, lambda **kw: self.fs.put_file(src, path, chunksize=chunk, **kw), nbytes=size)
        else:
            self._run("put_file", key, lambda **kw: self.fs.put_file(src, path, **kw),
                      nbytes=os.path.getsize(src))

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys``; missing ones are ignored (deletes are retried, so must be idempotent)."""
        keys = list(keys)
        paths = [self._path(k) for k in keys]
        if not keys:
            return
        if self.backend == "s3":  # batched DeleteObjects; S3 ignores missing keys itself
            for i in range(0, len(paths), 1000):
                batch = paths[i:i + 1000]
                self._run("delete", keys[i], lambda b=batch, **kw: self.fs.rm(b, **kw))
            return

        def rm(kp: tuple[str, str]) -> None:
            def fn(**kw: Any) -> None:
                try:
                    self.fs.rm_file(kp[1], **kw)
                except FileNotFoundError:
                    pass
            self._run("delete", kp[0], fn)

        self._map(rm, list(zip(keys, paths)))


def _describe(exc: BaseException, timeout: float | None) -> str:
    """One line for a backend error (a cancelled call's TimeoutError says nothing by itself)."""
    text = " ".join(str(exc).split())
    if isinstance(exc, TimeoutError) and not text and timeout is not None:
        text = f"no answer within {timeout:.1f} s"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
