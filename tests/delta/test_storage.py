"""Contract tests for ckptdelta.delta.storage.Store, run against every backend.

local and memory run in-process; s3 and gcs talk to real emulators (moto,
fake-gcs-server) started by tests/conftest.py, so conditional writes, multipart
uploads and error translation go over the wire.
"""

from __future__ import annotations

import errno
import os
import threading

import pytest

from ckptdelta.delta.errors import InvalidKeyError, ObjectExistsError, ObjectNotFoundError, StorageError
from ckptdelta.delta.storage import RetryPolicy, Store, is_transient

FAST_RETRY = RetryPolicy(attempts=4, base_delay=0.001, max_delay=0.005)

BAD_KEYS = ["", "/abs", "a//b", "a/", "../x", "a/../b", "a/./b", ".", "a\\b", "nul\x00x",
            "tab\tx", "glob*", "q?versionId=1", "br[0]"]


@pytest.fixture
def store(store_url):
    url, options = store_url
    s = Store.from_url(url, options, retry=FAST_RETRY)
    yield s
    s.close()


def _flaky(real, failures: int, exc_factory):
    """Wrap a filesystem method so its first ``failures`` calls raise."""
    state = {"calls": 0}

    def wrapper(*args, **kwargs):
        state["calls"] += 1
        if state["calls"] <= failures:
            raise exc_factory()
        return real(*args, **kwargs)

    wrapper.state = state
    return wrapper


class TestStoreContract:
    def test_backend_and_atomic_create(self, store, store_url):
        assert store.backend in {"local", "memory", "s3", "gcs"}
        assert store.atomic_create is True
        assert store.url.split("://")[0] in {"file", "memory", "s3", "gs"}

    def test_round_trip_and_overwrite(self, store):
        data = os.urandom(100_003)
        store.put("a/b/obj.bin", data)
        assert store.get("a/b/obj.bin") == data
        assert store.size("a/b/obj.bin") == len(data)
        info = store.info("a/b/obj.bin")
        assert info["size"] == len(data)
        assert isinstance(info["mtime"], float) and info["mtime"] > 1.5e9
        assert store.exists("a/b/obj.bin")
        assert not store.exists("a/b")  # a "directory" is not an object
        store.put("a/b/obj.bin", memoryview(b"second"))
        assert store.get("a/b/obj.bin") == b"second"
        store.put("ba", bytearray(b"xyz"))
        assert store.get("ba") == b"xyz"

    def test_empty_object(self, store):
        store.put("empty", b"")
        assert store.get("empty") == b""
        assert store.get("empty", max_size=10) == b""
        assert store.get("empty", (0, 0)) == b""
        assert store.get("empty", (0, 5)) == b""
        assert store.size("empty") == 0

    def test_byte_ranges(self, store):
        data = bytes(range(256)) * 4
        store.put("r", data)
        for start, end in [(0, 1), (3, 17), (100, 1024), (1023, 1024), (0, 1024)]:
            assert store.get("r", (start, end)) == data[start:end], (start, end)
        assert store.get("r", (5, 5)) == b""  # S3 would send the whole object for "bytes=5-4"
        assert store.get("r", (1000, 5000)) == data[1000:]  # short read at the end
        assert store.get("r", (1024, 2048)) == b""  # starts at the end (416 on S3/GCS)
        assert store.get("r", (4096, 8192)) == b""
        with pytest.raises(ValueError):
            store.get("r", (10, 5))
        with pytest.raises(ValueError):
            store.get("r", (-1, 5))

    def test_max_size(self, store):
        store.put("big", b"x" * 1000)
        assert store.get("big", max_size=1000) == b"x" * 1000
        with pytest.raises(StorageError) as ei:
            store.get("big", max_size=999)
        assert not isinstance(ei.value, ObjectNotFoundError)
        assert store.key_url("big") in str(ei.value) and "1000" in str(ei.value)
        assert store.get("big", (0, 10), max_size=10) == b"x" * 10
        with pytest.raises(StorageError):
            store.get("big", (0, 11), max_size=10)
        with pytest.raises(ObjectNotFoundError):
            store.get("missing", max_size=10)

    def test_missing_key(self, store):
        for call in (lambda: store.get("nope/x"), lambda: store.get("nope/x", (0, 4)),
                     lambda: store.get("nope/x", (2, 2)), lambda: store.size("nope/x"),
                     lambda: store.info("nope/x"), lambda: store.get_many([("nope/x", None)])):
            with pytest.raises(ObjectNotFoundError) as ei:
                call()
            assert isinstance(ei.value, FileNotFoundError)
            assert store.key_url("nope/x") in str(ei.value)
        assert not store.exists("nope/x")
        assert store.stats["retries"] == 0  # not-found is never retried

    def test_put_if_absent(self, store):
        store.put_if_absent("head/1", b"first")
        with pytest.raises(ObjectExistsError) as ei:
            store.put_if_absent("head/1", b"second")
        assert isinstance(ei.value, FileExistsError)
        assert store.key_url("head/1") in str(ei.value)
        assert store.get("head/1") == b"first"
        store.put("head/1", b"overwrite")  # plain put still overwrites
        with pytest.raises(ObjectExistsError):
            store.put_if_absent("head/1", b"overwrite")
        assert store.list_prefix("head/") == ["head/1"]  # no temp files left behind

    def test_put_if_absent_race(self, store):
        racers = 6
        barrier = threading.Barrier(racers)
        outcomes: list[object] = [None] * racers

        def race(i: int) -> None:
            barrier.wait()
            try:
                store.put_if_absent("lock", f"racer-{i}".encode())
                outcomes[i] = "won"
            except ObjectExistsError:
                outcomes[i] = "lost"
            except BaseException as e:  # surfaced by the assertion below
                outcomes[i] = e

        threads = [threading.Thread(target=race, args=(i,)) for i in range(racers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert outcomes.count("won") == 1, outcomes
        assert outcomes.count("lost") == racers - 1, outcomes
        assert store.get("lock") == f"racer-{outcomes.index('won')}".encode()

    def test_list_prefix(self, store):
        keys = ["a/b/c", "a/d", "ab", "z/1", "a/b/e/f", "a0"]
        for k in keys:
            store.put(k, k.encode())
        assert store.list_prefix("") == sorted(keys)
        assert store.list_prefix("a/") == ["a/b/c", "a/b/e/f", "a/d"]
        assert store.list_prefix("a/b") == ["a/b/c", "a/b/e/f"]
        assert store.list_prefix("a") == ["a/b/c", "a/b/e/f", "a/d", "a0", "ab"]
        assert store.list_prefix("nothing/") == []
        # a listing taken earlier must not hide later writes or deletes (no stale cache)
        store.put("a/new", b"n")
        assert "a/new" in store.list_prefix("a/")
        store.delete(["a/d"])
        assert "a/d" not in store.list_prefix("a/")

    def test_sees_writes_of_other_clients(self, store, store_url):
        """A loader polls for objects another process writes: no cached listing may hide them."""
        url, options = store_url
        other = Store.from_url(url, {**options, "skip_instance_cache": True}, retry=FAST_RETRY)
        if store.backend in ("s3", "gcs"):
            assert other.fs is not store.fs
        store.put("runs/1", b"1")
        assert store.list_prefix("runs/") == ["runs/1"]
        assert not store.exists("runs/2")
        other.put("runs/2", b"2")
        assert store.list_prefix("runs/") == ["runs/1", "runs/2"]
        assert store.exists("runs/2") and store.get("runs/2") == b"2"
        other.delete(["runs/1"])
        assert store.list_prefix("runs/") == ["runs/2"]
        assert not store.exists("runs/1")
        other.close()

    def test_delete(self, store):
        store.put("d/1", b"1")
        store.put("d/2", b"2")
        store.delete(["d/1", "d/missing", "d/2"])
        assert not store.exists("d/1") and not store.exists("d/2")
        assert store.list_prefix("d/") == []
        store.delete([])
        store.delete(["d/1"])  # idempotent

    def test_put_file_large(self, store, tmp_path):
        src = tmp_path / "big.bin"
        data = os.urandom(12 * 2**20 + 12345)
        src.write_bytes(data)
        store.put_file("blobs/big.bin", src)
        assert store.size("blobs/big.bin") == len(data)
        assert store.get("blobs/big.bin") == data
        assert store.get("blobs/big.bin", (5 * 2**20 - 3, 5 * 2**20 + 3)) == data[5 * 2**20 - 3:5 * 2**20 + 3]
        if store.backend == "s3":  # a multipart upload's ETag is "<md5 of md5s>-<parts>"
            etag = store.fs.info(store._path("blobs/big.bin"))["ETag"]
            assert etag.strip('"').endswith("-3"), etag
        store.put_file("blobs/big.bin", src)  # overwrite allowed

    @pytest.mark.parametrize("bad", BAD_KEYS)
    def test_invalid_keys(self, store, bad):
        calls = [lambda: store.get(bad), lambda: store.put(bad, b"x"),
                 lambda: store.put_if_absent(bad, b"x"), lambda: store.exists(bad),
                 lambda: store.delete([bad]), lambda: store.get_many([("ok", None), (bad, None)])]
        if bad not in ("", "a/"):
            calls.append(lambda: store.list_prefix(bad))
        for call in calls:
            with pytest.raises(InvalidKeyError) as ei:
                call()
            assert isinstance(ei.value, ValueError)
        assert store.stats["requests"] == 0  # refused before touching the backend

    def test_get_many_order(self, store):
        blobs = {f"m/{i:02d}": os.urandom(1000 + i) for i in range(24)}
        for k, v in blobs.items():
            store.put(k, v)
        req = [(k, None if i % 3 == 0 else (i, 500 + i)) for i, k in enumerate(reversed(list(blobs)))]
        got = store.get_many(req)
        want = [blobs[k] if r is None else blobs[k][r[0]:r[1]] for k, r in req]
        assert got == want
        assert store.get_many([]) == []

    def test_transient_errors_are_retried(self, store, monkeypatch):
        store.put("t", b"payload")
        for exc in (lambda: ConnectionResetError(errno.ECONNRESET, "reset by peer"),
                    lambda: OSError(errno.EBUSY, "SlowDown: reduce your request rate"),
                    lambda: TimeoutError("read timed out")):
            before = dict(store.stats)
            flaky = _flaky(store.fs.cat_file, 2, exc)
            monkeypatch.setattr(store.fs, "cat_file", flaky)
            assert store.get("t") == b"payload"
            assert flaky.state["calls"] == 3
            assert store.stats["retries"] - before["retries"] == 2
            assert store.stats["requests"] - before["requests"] == 3
            monkeypatch.undo()

    def test_permanent_failure_names_key(self, store, monkeypatch, caplog):
        store.put("p/q", b"payload")
        flaky = _flaky(store.fs.cat_file, 10**6, lambda: OSError(errno.EBUSY, "503 Slow Down"))
        monkeypatch.setattr(store.fs, "cat_file", flaky)
        with caplog.at_level("INFO", logger="ckptdelta.storage"):
            with pytest.raises(StorageError) as ei:
                store.get("p/q")
        assert not isinstance(ei.value, ObjectNotFoundError)
        assert store.key_url("p/q") in str(ei.value) and "Slow Down" in str(ei.value)
        assert flaky.state["calls"] == FAST_RETRY.attempts
        assert store.stats["retries"] == FAST_RETRY.attempts - 1
        assert len([r for r in caplog.records if r.name == "ckptdelta.storage"]) == FAST_RETRY.attempts - 1

    def test_non_transient_errors_are_not_retried(self, store, monkeypatch):
        store.put("n", b"x")
        monkeypatch.setattr(store.fs, "cat_file", _flaky(store.fs.cat_file, 1, lambda: PermissionError("denied")))
        with pytest.raises(StorageError, match="denied"):
            store.get("n")
        assert store.stats["retries"] == 0
        monkeypatch.setattr(store.fs, "cat_file", _flaky(store.fs.cat_file, 1, lambda: FileNotFoundError("gone")))
        with pytest.raises(ObjectNotFoundError):
            store.get("n")
        assert store.stats["retries"] == 0

    def test_put_if_absent_lost_response_is_success(self, store, monkeypatch):
        """The create landed but its answer was lost: the retry must not report a conflict."""
        def landed_then_reset(real):
            calls = {"n": 0}

            def wrapper(*args, **kwargs):
                calls["n"] += 1
                out = real(*args, **kwargs)
                if calls["n"] == 1:
                    raise ConnectionResetError(errno.ECONNRESET, "connection reset after write")
                return out
            return wrapper

        if store.backend == "local":
            monkeypatch.setattr(store, "_local_write", landed_then_reset(store._local_write))
        else:
            monkeypatch.setattr(store.fs, "pipe_file", landed_then_reset(store.fs.pipe_file))
        store.put_if_absent("once", b"mine")
        assert store.get("once") == b"mine"
        assert store.stats["retries"] == 1
        with pytest.raises(ObjectExistsError):  # someone else's bytes still conflict
            store.put_if_absent("once", b"theirs")


@pytest.mark.parametrize("store_url", ["local", "memory"], indirect=True)
def test_readers_never_see_partial_objects(store):
    """Overwrites done by this module (local, memory) are all-or-nothing for readers."""
    size = 1 << 20
    store.put("x", b"a" * size)
    stop = threading.Event()
    seen: set[bytes] = set()

    def reader() -> None:
        while not stop.is_set():
            data = store.get("x")
            seen.add(data[:1] if data in (b"a" * size, b"b" * size) else b"PARTIAL")

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(30):
            store.put("x", (b"a" if i % 2 else b"b") * size)
    finally:
        stop.set()
        t.join()
    assert b"PARTIAL" not in seen


def test_s3_and_gcs_error_classification():
    """Errors as s3fs/gcsfs really raise them: transient ones retry, the rest do not."""
    from botocore.exceptions import ClientError
    from gcsfs.retry import HttpError
    from s3fs.errors import translate_boto_error

    def s3_err(code: str, status: int, condition: str = "") -> Exception:
        err = {"Code": code, "Message": code}
        if condition:
            err["Condition"] = condition
        return translate_boto_error(ClientError(
            {"Error": err, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject"))

    assert is_transient(s3_err("SlowDown", 503))
    assert is_transient(s3_err("InternalError", 500))
    assert is_transient(s3_err("ThrottlingException", 400))
    assert is_transient(s3_err("RequestTimeout", 400))
    assert not is_transient(s3_err("NoSuchKey", 404))
    assert not is_transient(s3_err("AccessDenied", 403))
    assert not is_transient(s3_err("PreconditionFailed", 412, "If-None-Match"))
    assert not is_transient(s3_err("InvalidRange", 416))
    assert is_transient(HttpError({"code": 503, "message": "backend"}))
    assert is_transient(HttpError({"code": 429, "message": "rate"}))
    assert not is_transient(HttpError({"code": 416, "message": "range"}))
    assert not is_transient(ValueError("bad"))


def test_store_from_plain_path_and_file_url(tmp_path):
    a = Store.from_url(str(tmp_path / "r"))
    b = Store.from_url((tmp_path / "r").as_uri())
    a.put("k", b"v")
    assert b.get("k") == b"v"
    assert a.url == b.url and a.url.startswith("file://")
    # nothing escapes the root, and no temp files remain
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["k"]


def test_other_fsspec_backend_falls_back_to_check_then_write():
    """A backend without a known create-only write still refuses a sequential second create."""
    s = Store.from_url(f"dir::memory://ckd-other-{os.getpid()}-{threading.get_ident()}/run")
    try:
        assert s.backend == "other" and s.atomic_create is False
        s.put_if_absent("c", b"1")
        with pytest.raises(ObjectExistsError):
            s.put_if_absent("c", b"2")
        s.put("a/b", b"x")
        assert s.list_prefix("") == ["a/b", "c"]
        assert s.get("c") == b"1"
        s.delete(["a/b", "c", "missing"])
        assert s.list_prefix("") == []
    finally:
        s.close()
